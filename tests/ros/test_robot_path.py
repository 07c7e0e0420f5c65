"""The robot-facing path as ros2_control and nav2 users expect it, against the real agent process
over DDS (tiny random model): the heartbeat keeps beating while a `Decide` call waits, follows a
remapped command topic and is silent while the node is inactive; an inactive node rejects RunTask
goals; a String on the `goal` topic never aborts a running RunTask goal."""
import time

from action_msgs.msg import GoalStatus
from diagnostic_msgs.msg import DiagnosticArray
from lifecycle_msgs.msg import Transition
from rclpy.action import ActionClient
from std_msgs.msg import Header, String
from tokenspeed_msgs.action import RunTask
from tokenspeed_msgs.msg import ActionCommand
from tokenspeed_msgs.srv import Decide

from agent_support import Lifecycle, SensorFeed, delayed_agent
from test_agent_node import ENGINE_TIMEOUT, LATCHED

TASK = "Put the red cube on the yellow target at x=0.53 y=0.11."
HEARTBEAT_GAP_S = 0.2           # the robot's command timeout must never see a longer silence

# The one injected fault, because it cannot be caused from outside the process: an engine that
# takes longer than the whole deadline budget (a hung forward). Decide then waits the full budget
# for the deadline monitor's fallback.
STALLED_ENGINE = delayed_agent("tokenspeed.session", "Session", "decide", 10.0)


def beats(probe, topic: str, stamps: list | None = None) -> list[float]:
    """Receive times (time.monotonic(), s) of the heartbeats on `topic`; their own stamps (node
    clock, s) go to `stamps` when given."""
    times = []

    def heard(msg: Header) -> None:
        times.append(time.monotonic())
        if stamps is not None:
            stamps.append((time.time(), msg.stamp.sec + msg.stamp.nanosec * 1e-9))
    probe.node.create_subscription(Header, topic, heard, 10)
    return times


def test_heartbeat_keeps_beating_during_a_3_s_decide(probe, start_agent):
    """The gaps are those between the heartbeats' own stamps: the agent's beat. (The probe's
    receive times add this test process's scheduling on a loaded 2-core machine; they are checked
    against a looser bound.)"""
    stamps = []
    heard = beats(probe, "agent/action/heartbeat", stamps)
    SensorFeed(probe)
    agent = start_agent(code=STALLED_ENGINE, model="tiny-random", deadline_budget_s=3.0, decision_period_s=0.0,
                        decide_on_scene_change="false", decide_on_goal="false")
    client = probe.node.create_client(Decide, "decide")
    assert probe.spin_until(client.service_is_ready, ENGINE_TIMEOUT), agent.log_path.read_text()
    assert probe.spin_until(lambda: len(heard) > 5, 10), agent.log_path.read_text()
    probe.spin_until(lambda: False, 1.0)        # sensors fresh
    started, started_wall = time.monotonic(), time.time()
    future = client.call_async(Decide.Request())
    assert probe.spin_until(future.done, 30), agent.log_path.read_text()
    ended, ended_wall = time.monotonic(), time.time()
    r = future.result()
    assert not r.success and r.reason == "deadline_missed" and r.command.source == "fallback", r
    assert ended - started >= 2.5                 # the call really waited out the 3 s budget
    sent = [stamp for received, stamp in stamps if started_wall - 0.5 <= received <= ended_wall]
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert len(sent) > 20 and max(gaps) <= HEARTBEAT_GAP_S, f"heartbeat gaps during Decide: max {max(gaps):.3f} s"
    during = [t for t in heard if started - 0.5 <= t <= ended]
    assert max(b - a for a, b in zip(during, during[1:])) <= 2 * HEARTBEAT_GAP_S    # as received


def test_remapped_command_topic_carries_its_heartbeat(probe, start_agent):
    remapped = beats(probe, "/robot3/cmd/heartbeat")
    default = beats(probe, "agent/action/heartbeat")
    commands = probe.listen(ActionCommand, "/robot3/cmd")
    SensorFeed(probe)
    agent = start_agent(remaps={"agent/action": "/robot3/cmd"}, model="tiny-random", tool_choice="hold",
                        deadline_budget_s=30.0, decision_period_s=0.3, decide_without_task="true")
    assert probe.spin_until(lambda: len(remapped) > 5 and commands, ENGINE_TIMEOUT), agent.log_path.read_text()
    assert default == []
    assert all(c.header.frame_id == "base" for c in commands)      # every command names its frame


def test_two_namespaced_agents_diagnostics_are_told_apart(probe, start_agent):
    diags = probe.listen(DiagnosticArray, "/diagnostics")
    agents = [start_agent(remaps={"__ns": f"/cell{i}"}, model="tiny-random", tool_choice="hold",
                          decision_period_s=0.5, deadline_budget_s=30.0) for i in (1, 2)]

    def names():
        return {(s.name, s.hardware_id) for m in diags for s in m.status}
    want = {(f"/cell{i}/tokenspeed_agent: {part}", f"/cell{i}/tokenspeed_agent")
            for i in (1, 2) for part in ("decisions", "inputs", "engine")}
    assert probe.spin_until(lambda: want <= names(), ENGINE_TIMEOUT), [a.log_path.read_text() for a in agents]


def test_inactive_node_is_silent_and_rejects_goals(probe, start_agent):
    heard = beats(probe, "agent/action/heartbeat")
    SensorFeed(probe)
    agent = start_agent(autostart="false", model="tiny-random", deadline_budget_s=30.0, decision_period_s=0.3)
    life = Lifecycle(probe)
    assert life.change(Transition.TRANSITION_CONFIGURE, ENGINE_TIMEOUT), agent.log_path.read_text()
    client = ActionClient(probe.node, RunTask, "run_task")
    assert probe.spin_until(client.server_is_ready, 30)
    probe.spin_until(lambda: False, 1.0)
    assert heard == [], "an inactive node beats: the robot would think it commands"
    sent = client.send_goal_async(RunTask.Goal(task=TASK))
    assert probe.spin_until(sent.done, 10) and not sent.result().accepted
    assert "inactive" in agent.log_path.read_text()

    assert life.change(Transition.TRANSITION_ACTIVATE)
    assert probe.spin_until(lambda: len(heard) > 3, 5)
    # a goal that could never decide (its only tool is the completion tool, which the gripper's
    # state does not offer) is rejected rather than falling back until cancelled
    sent = client.send_goal_async(RunTask.Goal(task=TASK, tools=["task_done"]))
    assert probe.spin_until(sent.done, 10) and not sent.result().accepted
    assert "may be called with the gripper empty" in agent.log_path.read_text()
    sent = client.send_goal_async(RunTask.Goal(task=TASK))
    assert probe.spin_until(sent.done, 10) and sent.result().accepted

    assert life.change(Transition.TRANSITION_DEACTIVATE)
    probe.spin_until(lambda: False, 0.5)
    n = len(heard)
    probe.spin_until(lambda: False, 1.0)
    assert len(heard) == n, "the heartbeat went on after deactivate"


def test_goal_string_does_not_abort_a_running_goal(probe, start_agent):
    goal_pub = probe.node.create_publisher(String, "goal", LATCHED)
    SensorFeed(probe)
    agent = start_agent(goal_topic="goal", model="tiny-random", tool_choice="hold", deadline_budget_s=30.0,
                        decision_period_s=0.3)
    client = ActionClient(probe.node, RunTask, "run_task")
    assert probe.spin_until(client.server_is_ready, ENGINE_TIMEOUT), agent.log_path.read_text()
    feedback = []
    sent = client.send_goal_async(RunTask.Goal(task=TASK, tools=["hold"]),
                                  feedback_callback=lambda m: feedback.append(m.feedback))
    assert probe.spin_until(sent.done, 10) and sent.result().accepted
    handle = sent.result()
    assert probe.spin_until(lambda: len(feedback) >= 2, 60), agent.log_path.read_text()
    goal_pub.publish(String(data="Stack the blue cube on the red cube."))
    n = len(feedback)
    result = handle.get_result_async()
    assert probe.spin_until(lambda: len(feedback) >= n + 3 or result.done(), 30)
    assert not result.done(), result.result()
    assert "goal topic ignored" in agent.log_path.read_text()
    cancel = handle.cancel_goal_async()
    assert probe.spin_until(lambda: cancel.done() and result.done(), 10)
    assert result.result().status == GoalStatus.STATUS_CANCELED
