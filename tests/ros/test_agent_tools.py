"""Action masking by gripper state in the real `tokenspeed_agent` process: the tools a decision
may call follow what the gripper holds (tracked from the robot's feedback), the state line is
restated before decisions, and the tool-list parameters are validated."""
import json

import pytest
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from std_msgs.msg import String
from tokenspeed_msgs.msg import ActionCommand, ActionFeedback, Observation

from agent_support import SensorFeed
from tokenspeed_ros.context_policy import GripperState, goal_brief, task_brief

LATCHED = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
ENGINE_TIMEOUT = 90.0          # process start + model load on a busy 2-core machine, seconds
GOAL = ("Put the red cube on the yellow target at x=0.53 y=0.11 (metres, robot base frame): "
        "pick it, then place it there.")


def test_gripper_state_follows_the_robots_feedback():
    g = GripperState()
    g.sent(1, "pick", '{"object": "red_cube"}')
    g.sent(2, "place", '{"x": 0.5, "y": 0.1}')
    assert not g.feedback(1, "pick", "applied", "") and g.text() == "gripper empty"
    assert g.feedback(1, "pick", "done", "ok") and g.text() == "gripper holding red_cube"
    assert not g.feedback(2, "place", "preempted", "") and g.holding == "red_cube"
    assert g.feedback(2, "place", "done", "ok") and g.holding is None
    assert not g.feedback(1, "pick", "done", "grasp of red_cube failed") and g.holding is None
    # the robot's own word corrects a missed event
    assert g.feedback(9, "pick", "rejected", "pick: already holding blue_cube; place it first")
    assert g.holding == "blue_cube"
    assert g.feedback(9, "place", "rejected", "place: not holding a cube; pick one first") and g.holding is None


def test_state_line_restates_the_goal_without_its_remarks():
    assert task_brief(GOAL) == "Put the red cube on the yellow target at x=0.53 y=0.11: pick it, then place it there."
    assert task_brief("hold still") == "hold still"


def test_allowed_tools_follow_the_gripper_state(probe, start_agent):
    """tiny-random model (random choices within the grammar): while empty only pick is allowed,
    after the robot reports the pick done only place, after the place done pick again. The
    state line (objects; gripper; task) is echoed before decisions."""
    actions = probe.listen(ActionCommand, "agent/action")
    observations = probe.listen(Observation, "agent/observation")
    feedback = probe.node.create_publisher(ActionFeedback, "sim/action_feedback", 10)
    probe.node.create_publisher(String, "goal", LATCHED).publish(String(data=GOAL))
    SensorFeed(probe)
    agent = start_agent(goal_topic="goal", model="tiny-random", deadline_budget_s=30.0, decision_period_s=0.2,
                        tools_when_empty="[pick]", tools_when_holding="[place]")

    def model_after(first_id):
        return [a for a in actions if a.source == "model" and a.decision_id >= first_id]

    def state_echoed(text):
        return any(o.source == "state" and text in o.text for o in observations)

    def next_state(line, tool, expect):
        """Report `tool` done for the newest model call, wait for the state line to say
        `line`, then check the next model decisions (opened after it) call `expect`."""
        last = model_after(0)[-1]
        feedback.publish(ActionFeedback(decision_id=last.decision_id, tool_name=tool, state="done", detail="ok"))
        assert probe.spin_until(lambda: state_echoed(line), 30), agent.log_path.read_text()
        first = max(a.decision_id for a in actions) + 2      # topics are not ordered with each other
        assert probe.spin_until(lambda: len(model_after(first)) >= 3, 60), agent.log_path.read_text()
        assert {a.tool_name for a in model_after(first)} == {expect}
        return model_after(first)

    assert probe.spin_until(lambda: len(model_after(0)) >= 3, ENGINE_TIMEOUT), agent.log_path.read_text()
    assert {a.tool_name for a in model_after(0)} == {"pick"}
    assert state_echoed(f"objects blue_cube=(0.40,-0.10) red_cube=(0.50,0.10); gripper empty; task: {task_brief(GOAL)}")
    held = json.loads(model_after(0)[-1].arguments_json)["object"]
    next_state(f"carrying {held}; {goal_brief(GOAL)}", "pick", "place")
    next_state("gripper empty; task: ", "place", "pick")
    assert agent.poll() is None


@pytest.mark.parametrize("params, message", [
    (dict(tools_when_holding="[place, fly]"), "tools_when_holding names unknown tool 'fly'"),
    (dict(tools_when_empty="[pick, pick]"), "tools_when_empty lists a tool twice"),
    (dict(tools_when_empty="[1, 2]"), "tools_when_empty"),
], ids=["unknown", "duplicate", "type"])
def test_bad_tool_lists_are_refused_by_name(start_agent, params, message):
    agent = start_agent(model="/nonexistent/model.gguf", **params)
    assert agent.wait(60) == 2
    assert message in agent.log_path.read_text()


def test_a_call_just_sent_is_not_preempted_before_the_robot_answers(probe, start_agent):
    """The robot's feedback topic is on, but this robot never answers: after each model call the
    agent waits APPLY_WAIT_S for the robot to take it up before a rate trigger (every 0.1 s) may
    decide again, so the next call cannot preempt one the robot has not even applied yet."""
    from tokenspeed_ros.context_policy import APPLY_WAIT_S

    actions = probe.listen(ActionCommand, "agent/action")
    probe.node.create_publisher(String, "goal", LATCHED).publish(String(data=GOAL))
    SensorFeed(probe)
    agent = start_agent(goal_topic="goal", model="tiny-random", deadline_budget_s=30.0, decision_period_s=0.1,
                        tools_when_empty="[pick]")

    def published_s():       # publish times of the model's calls, seconds
        return [a.header.stamp.sec + a.header.stamp.nanosec * 1e-9 for a in actions if a.source == "model"]

    assert probe.spin_until(lambda: len(published_s()) >= 4, ENGINE_TIMEOUT), agent.log_path.read_text()
    stamps = published_s()
    assert min(b - a for a, b in zip(stamps, stamps[1:])) >= APPLY_WAIT_S, stamps
