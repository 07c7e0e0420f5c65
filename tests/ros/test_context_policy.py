"""The agent's context policy: the lean state line, the state it predicts for a call's success,
and `ContextPolicy` (what enters the context and when, the tools each decision may call, the
robot's execution), all without ROS and without a model."""
import subprocess
import sys
from types import SimpleNamespace

from tokenspeed_ros.context_policy import (ACHIEVED, APPLY_WAIT_S, ContextPolicy, GripperState, effect, goal_brief,
                                           predicted_state, state_line, task_brief)
from tokenspeed_ros.task import Task

GOAL = ("Put the red cube on the yellow target at x=0.53 y=0.11 (metres, robot base frame): "
        "pick it, then place it there.")
OBJECTS = "objects blue_cube=(0.59,0.21) red_cube=(0.54,-0.12)"


def test_the_state_line_has_objects_only_while_the_gripper_is_empty_and_the_task_last():
    assert state_line(OBJECTS, None, GOAL, False) == f"{OBJECTS}; gripper empty; task: {task_brief(GOAL)}"
    assert state_line(OBJECTS, "red_cube", GOAL, False) == f"carrying red_cube; {goal_brief(GOAL)}"
    assert state_line(OBJECTS, None, GOAL, True) == ACHIEVED
    assert state_line(OBJECTS, None, None, False) == f"{OBJECTS}; gripper empty"
    assert state_line(OBJECTS, "red_cube", None, False) == "carrying red_cube"


def test_while_holding_the_line_restates_the_goal_alone_in_fewer_tokens():
    """The goal up to its first ':' or sentence end, numbers without a leading zero (same rounding)."""
    assert goal_brief(GOAL) == "Put the red cube on the yellow target at x=.53 y=.11"
    assert goal_brief("Go to x=10.05 y=-0.20. Then stop.") == "Go to x=10.05 y=-.20"
    assert goal_brief("Stack the blue cube on the red one, e.g. at x=0.5.") == "Stack the blue cube on the red one, e.g. at x=.5"
    assert goal_brief("hold still") == "hold still"


def test_each_tool_declares_its_effect_on_the_gripper():
    assert effect("pick", {"object": "red_cube"}, None) == "red_cube"
    assert effect("place", {"x": 0.5, "y": 0.1}, "red_cube") is None
    assert effect("move_to", {"x": 0.5, "y": 0.1, "z": 0.2}, "red_cube") == "red_cube"
    assert effect("hold", {}, None) is None


def test_the_state_after_a_pick_is_predicted_from_the_call_alone():
    """The line predicted for pick(x) is the line the agent writes once the robot reports it done,
    whatever the camera sees then; a place leads to an empty gripper, whose line depends on
    perception: no prediction."""
    predicted, holding = predicted_state("pick", {"object": "red_cube"}, None, GOAL)
    g = GripperState()
    g.sent(3, "pick", '{"object": "red_cube"}')
    assert g.feedback(3, "pick", "done", "ok") and g.holding == holding == "red_cube"
    assert predicted == state_line("objects green_cube=(0.36,-0.24)", g.holding, GOAL, False)
    assert predicted_state("place", {"x": 0.53, "y": 0.11}, "red_cube", GOAL) is None
    assert predicted_state("hold", {}, None, GOAL) is None


# ---------------------------------------------------------------- ContextPolicy (no rclpy, no model)
def params(**changes):
    """The AgentParams fields the policy reads, at the agent's defaults (a plain object: no rclpy)."""
    values = dict(restate_before_decisions=True, observe_while_executing=False, decide_while_executing=False,
                  execution_timeout_s=30.0, tools_when_empty=["pick", "move_to", "hold", "stop"],
                  tools_when_holding=["place", "move_to", "hold", "stop"], tool_choice="required",
                  task_status_topic="sim/scenario_status", action_feedback_topic="sim/action_feedback", decide_ahead=True,
                  decide_without_task=False)
    return SimpleNamespace(**{**values, **changes})


class Recorder:
    """The engine worker's side of the policy: records what the policy hands it, in order."""

    def __init__(self):
        self.calls = []

    def observe(self, source, text, stamp_s, kind="sensor"):
        self.calls.append(("observe", source, text))

    def new_episode(self):
        self.calls.append(("new_episode",))

    def decide_ahead(self, restate, tool_choice):
        self.calls.append(("decide_ahead", restate[1], allowed(tool_choice)))


def allowed(tool_choice):
    return [t["function"]["name"] for t in tool_choice["allowed_tools"]["tools"]]


TOOLS = ["pick", "place", "move_to", "hold", "stop", "task_done"]


def started(p, now_s=0.0):
    worker = Recorder()
    ctx = ContextPolicy(worker, TOOLS)
    ctx.submit(p, "camera", OBJECTS, now_s, now_s)
    worker.calls.clear()
    ctx.start_task(p, Task(GOAL, None), now_s)
    return ctx, worker


def test_the_context_policy_imports_without_rclpy():
    code = ("import sys, tokenspeed_ros.context_policy; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('rclpy', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_task_starts_a_new_episode_with_the_goal_in_the_state_line():
    p = params()
    ctx, worker = started(p)
    line = state_line(OBJECTS, None, GOAL, False)
    assert worker.calls == [("new_episode",), ("observe", "state", line)]
    assert ctx.before_decision(p, 1.0) == ("state", line, 1.0)
    assert allowed(ctx.tool_choice(p)) == ["pick", "move_to", "hold", "stop"]


def test_no_state_line_is_prefilled_while_no_task_runs_unless_deciding_without_one():
    """Before the first task nothing decides and the task's new episode drops whatever was prefilled:
    the camera's readings leave the engine free for the task's first call (which restates the line
    with the goal); with decide_without_task they stream in as state lines, as during a task."""
    p = params()
    worker = Recorder()
    ctx = ContextPolicy(worker, TOOLS)
    assert ctx.submit(p, "camera", OBJECTS, 0.0, 0.0)
    assert worker.calls == []
    ctx.start_task(p, Task(GOAL, None), 1.0)
    assert worker.calls == [("new_episode",), ("observe", "state", state_line(OBJECTS, None, GOAL, False))]
    deciding = params(decide_without_task=True)
    worker = Recorder()
    ctx = ContextPolicy(worker, TOOLS)
    assert ctx.submit(deciding, "camera", OBJECTS, 0.0, 0.0)
    assert worker.calls == [("observe", "state", state_line(OBJECTS, None, None, False))]


def test_readings_wait_while_the_robot_executes_and_go_in_after_the_decision():
    """A model call sent: the robot has APPLY_WAIT_S to answer; once applied it executes until its
    feedback ends it (or execution_timeout_s). Camera readings meanwhile are held back, and the
    newest goes in once the next decision was requested; the call's end asks for a decision."""
    p = params()
    ctx, worker = started(p)
    ctx.on_published(p, 7, "move_to", '{"x": 0.5, "y": 0.1, "z": 0.2}', "model", 10.0)
    assert ctx.robot_executing(p, 10.0 + APPLY_WAIT_S / 2) and not ctx.robot_executing(p, 10.0 + APPLY_WAIT_S)
    assert not ctx.on_feedback(p, 7, "move_to", "applied", "", 10.2)
    assert ctx.robot_executing(p, 39.0) and not ctx.robot_executing(p, 40.3)
    worker.calls.clear()
    moved = "objects red_cube=(0.50,0.10)"
    assert ctx.submit(p, "camera", moved, 11.0, 11.0) and ctx.submit(p, "joint_states", "joints q", 11.0, 11.0)
    assert worker.calls == []
    assert ctx.on_feedback(p, 7, "move_to", "done", "ok", 12.0) and not ctx.robot_executing(p, 12.0)
    # the decision restates the state line with the newest objects; the joints follow it
    assert ctx.before_decision(p, 12.0)[1] == state_line(moved, None, GOAL, False)
    ctx.release_held(p)
    assert worker.calls == [("observe", "joint_states", "joints q")]
    assert not ctx.robot_executing(params(decide_while_executing=True), 10.1)


def test_a_pick_sent_decides_the_place_ahead_and_a_rejection_is_told():
    p = params()
    ctx, worker = started(p)
    worker.calls.clear()
    ctx.on_published(p, 3, "pick", '{"object": "red_cube"}', "model", 5.0)
    assert worker.calls == [("decide_ahead", state_line("", "red_cube", GOAL, False),
                             ["place", "move_to", "hold", "stop"])]
    worker.calls.clear()
    ctx.on_published(p, 4, "hold", "{}", "fallback", 6.0)     # a fallback is not decided ahead
    assert worker.calls == []
    assert ctx.on_feedback(p, 3, "pick", "rejected", "pick: already holding blue_cube", 6.5) is False
    assert ctx.gripper.holding == "blue_cube"
    assert ("observe", "robot", "robot: pick rejected (pick: already holding blue_cube) (decision 3)") in worker.calls


def test_requests_are_refused_for_unknown_or_uncallable_tools_and_the_achieved_task_offers_completion():
    p = params()
    ctx, worker = started(p)
    assert ctx.refusal(p, ["fly"]) == "unknown tools ['fly']"
    assert "none of the tools ['place']" in ctx.refusal(p, ["place"])
    assert ctx.refusal(p, ["pick"]) is None and ctx.refusal(params(tool_choice="pick"), ["place"]) is None
    assert ctx.on_status(p, {"success": True, "target_object": "red_cube"}, 3.0)
    assert worker.calls[-1] == ("observe", "state", ACHIEVED)
    assert allowed(ctx.tool_choice(p)) == ["task_done"] and ctx.done_evidence(p)
