"""Tasks as a ROS action and one decision as a service, against the real agent process over DDS
(tiny random model: its choices are random within the grammar). The robot cell's status topic
comes from the probe, as a robot would publish it: the task is done only once it reports success
and the model then calls the completion tool; cancel stops the agent with the arm holding."""
import json

import pytest
from action_msgs.msg import GoalStatus
from rclpy.action import ActionClient
from std_msgs.msg import String
from tokenspeed_msgs.action import RunTask
from std_msgs.msg import Header
from tokenspeed_msgs.msg import ActionCommand, DeadlineStatus
from tokenspeed_msgs.srv import Decide

from agent_support import SensorFeed, delayed_agent
from test_agent_node import ENGINE_TIMEOUT, LATCHED

TASK = "Put the red cube on the yellow target at x=0.53 y=0.11."


def start(probe, start_agent):
    actions = probe.listen(ActionCommand, "agent/action")
    statuses = probe.listen(DeadlineStatus, "agent/deadline_status")
    status_pub = probe.node.create_publisher(String, "sim/scenario_status", LATCHED)
    status_pub.publish(String(data=json.dumps({"success": False, "target_object": "red_cube", "distance_m": 0.2})))
    heartbeats = probe.listen(Header, "agent/action/heartbeat")
    SensorFeed(probe)
    agent = start_agent(model="tiny-random", deadline_budget_s=30.0, decision_period_s=0.3, goal_topic="''")
    client = ActionClient(probe.node, RunTask, "run_task")
    assert probe.spin_until(client.server_is_ready, ENGINE_TIMEOUT), agent.log_path.read_text()
    assert probe.spin_until(lambda: heartbeats, ENGINE_TIMEOUT), agent.log_path.read_text()    # active
    return agent, client, actions, statuses, status_pub


def send(probe, client, goal: RunTask.Goal):
    feedback = []
    sent = client.send_goal_async(goal, feedback_callback=lambda m: feedback.append(m.feedback))
    assert probe.spin_until(sent.done, 30)
    handle = sent.result()
    assert handle.accepted
    return handle, feedback


def test_task_runs_with_feedback_until_the_model_calls_task_done(probe, start_agent):
    """Active and fed by the sensors, the agent decides nothing before its first task (no decision
    for a new task to cut short: decide_without_task false); then it decides until the task is done."""
    agent, client, actions, _, status_pub = start(probe, start_agent)
    probe.spin_until(lambda: False, 1.5)        # five rate periods
    assert actions == [], "decided without a task"
    handle, feedback = send(probe, client, RunTask.Goal(task=TASK))
    assert probe.spin_until(lambda: sum(f.source == "model" for f in feedback) >= 3, 60), agent.log_path.read_text()
    assert all(f.tool_name != "task_done" and f.latency_s > 0 for f in feedback)    # not offered yet

    status_pub.publish(String(data=json.dumps({"success": True, "target_object": "red_cube", "distance_m": 0.012,
                                               "tolerance_m": 0.05})))
    result = handle.get_result_async()
    assert probe.spin_until(result.done, 30), agent.log_path.read_text()
    r = result.result()
    assert r.status == GoalStatus.STATUS_SUCCEEDED and r.result.outcome == "done"
    assert "task_done" in r.result.evidence and "success" in r.result.evidence and "1.2 cm" in r.result.evidence
    assert r.result.decisions >= 4 and feedback[-1].status == "task_done" and feedback[-1].tool_name == "hold"
    # done: the agent stops acting (no decision after the completion call; topics are not ordered
    # with the result, so the completion's own hold may arrive after it)
    probe.spin_until(lambda: False, 2.0)
    assert max(a.decision_id for a in actions) == feedback[-1].decision_id
    assert "task done: decision" in agent.log_path.read_text()


def test_a_tasks_first_call_is_decided_ahead_and_goes_out_when_ready_on_an_unchanged_frame(probe, start_agent):
    """The task's first call is decided ahead on the newest frame's state line (nothing goes out
    meanwhile) and is published once ready, the newest frame's line being the same: a hit, with
    nothing prefilled after that frame."""
    agent, client, actions, _, _ = start(probe, start_agent)
    traces = probe.listen(String, "agent/action/trace")
    handle, feedback = send(probe, client, RunTask.Goal(task=TASK, tools=["move_to", "hold", "stop"]))
    assert probe.spin_until(lambda: any(f.source == "model" for f in feedback), 60), agent.log_path.read_text()
    first = next(f for f in feedback if f.source == "model")
    assert probe.spin_until(lambda: any(json.loads(t.data)["decision_id"] == first.decision_id for t in traces), 5)
    trace = next(json.loads(t.data) for t in traces if json.loads(t.data)["decision_id"] == first.decision_id)
    assert trace["ahead"] == "hit" and trace["prefill_tokens"] == 0, trace
    assert trace["times"]["ahead_decide_ms"] > 0 and trace["tokens_in"] > 0
    assert "decided ahead: " in agent.log_path.read_text()


def test_cancel_mid_task_leaves_the_arm_holding(probe, start_agent):
    agent, client, actions, statuses, _ = start(probe, start_agent)
    handle, feedback = send(probe, client, RunTask.Goal(task=TASK, tools=["stop", "hold"], max_decisions=1000))
    assert probe.spin_until(lambda: sum(f.source == "model" for f in feedback) >= 2, 60), agent.log_path.read_text()
    assert {f.tool_name for f in feedback if f.source == "model"} <= {"stop", "hold"}     # the goal's tools
    cancel = handle.cancel_goal_async()
    assert probe.spin_until(cancel.done, 10)
    result = handle.get_result_async()
    assert probe.spin_until(result.done, 10)
    assert result.result().status == GoalStatus.STATUS_CANCELED and result.result().result.outcome == "cancelled"
    assert probe.spin_until(lambda: any(s.reason == "cancelled" for s in statuses), 5)
    held = next(s for s in statuses if s.reason == "cancelled")
    assert probe.spin_until(lambda: any(a.decision_id == held.decision_id for a in actions), 5)
    assert next(a for a in actions if a.decision_id == held.decision_id).tool_name == "hold"
    probe.spin_until(lambda: False, 1.0)
    n = len(actions)
    probe.spin_until(lambda: False, 1.5)
    assert len(actions) == n, "the agent kept acting after cancel"
    # a goal naming a tool the agent does not have is rejected
    sent = client.send_goal_async(RunTask.Goal(task=TASK, tools=["fly"]))
    assert probe.spin_until(sent.done, 10) and not sent.result().accepted


def test_decide_service_answers_one_decision(probe, start_agent):
    """Decide answers without a task (an explicit request; nothing else decides then)."""
    agent, _, actions, _, _ = start(probe, start_agent)
    client = probe.node.create_client(Decide, "decide")
    assert probe.spin_until(client.service_is_ready, 30)
    probe.spin_until(lambda: False, 1.0)        # sensors are in
    future = client.call_async(Decide.Request(tools=["hold"]))
    assert probe.spin_until(future.done, 30), agent.log_path.read_text()
    r = future.result()
    assert r.success and r.reason == "ok" and r.command.tool_name == "hold" and r.command.source == "model"
    assert probe.spin_until(lambda: any(a.decision_id == r.command.decision_id for a in actions), 5)
    bad = client.call_async(Decide.Request(tools=["fly"]))
    assert probe.spin_until(bad.done, 10)
    assert not bad.result().success and "fly" in bad.result().reason


# The injected fault: the engine thread is held up for 1.5 s while it hands over a call decided
# ahead. A hit is handed over within a millisecond of its request, so it is late only when that
# thread is starved (CPU, GIL); nothing outside the process can cause that on cue.
LATE_HIT = delayed_agent("tokenspeed_ros.engine_worker", "EngineWorker", "_take_ahead", 1.5)


@pytest.mark.slow
def test_a_call_decided_ahead_and_dropped_as_late_leaves_the_context(probe, start_agent):
    """The embedded model (SmolLM2-135M). The task's first call is decided ahead, but handed over
    after its deadline (0.5 s budget, the injected hold-up above): the monitor publishes the
    fallback and drops the call as late. The call must not stay in the context as if the robot had
    executed it: the session rolls back to before it (its state line unanswered again), so the next
    decision, on the same frame, decides in the context the dropped call was decided in (fewer
    tokens than with the call) and, greedy, gives the same call."""
    actions = probe.listen(ActionCommand, "agent/action")
    statuses = probe.listen(DeadlineStatus, "agent/deadline_status")
    traces = probe.listen(String, "agent/action/trace")
    SensorFeed(probe)
    agent = start_agent(code=LATE_HIT, deadline_budget_s=0.5, decision_period_s=0.5, goal_topic="''")
    client = ActionClient(probe.node, RunTask, "run_task")
    assert probe.spin_until(client.server_is_ready, ENGINE_TIMEOUT), agent.log_path.read_text()
    handle = None
    while handle is None or not handle.accepted:      # accepted once the agent is active
        sent = client.send_goal_async(RunTask.Goal(task=TASK, tools=["pick", "hold"]))
        assert probe.spin_until(sent.done, 30)
        handle = sent.result()
        probe.spin_until(lambda: False, 0.2)

    def record(i):
        return next((json.loads(t.data) for t in traces if json.loads(t.data)["decision_id"] == i), None)

    def dropped():
        return next((s.decision_id for s in statuses if s.reason == "late_result_dropped"), None)

    assert probe.spin_until(lambda: dropped() is not None and record(dropped()) is not None, 60), agent.log_path.read_text()
    late = record(dropped())
    assert late["ahead"] == "hit" and late["status"] == "ok" and late["tool"] == "pick", late
    assert not any(a.decision_id == late["decision_id"] and a.source == "model" for a in actions)

    def after(status=None):     # the engine's first decision after the dropped one (with `status`)
        return next((r for r in map(json.loads, (t.data for t in traces))
                     if r["decision_id"] > late["decision_id"] and r["times"].get("queued")
                     and status in (None, r["status"])), None)

    assert probe.spin_until(lambda: after("ok") is not None, 60), agent.log_path.read_text()
    nxt, ok = after(), after("ok")      # the same unless nxt missed its own deadline (rolled back too)
    assert nxt["ahead"] == "" and nxt["prefill_tokens"] == 0, nxt    # the state line is still the last message
    assert nxt["context_tokens"] < late["context_tokens"], (nxt, late)  # without the dropped call
    assert ok["context_tokens"] == nxt["context_tokens"] and ok["tool"] == late["tool"], (ok, nxt)
    assert f"decision {late['decision_id']}: its call was not executed: rolled back" in agent.log_path.read_text()
