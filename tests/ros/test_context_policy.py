"""The agent's lean state line and the state it predicts for a call's success (no ROS, no model)."""
from tokenspeed_ros.context_policy import ACHIEVED, GripperState, effect, predicted_state, state_line, task_brief

GOAL = ("Put the red cube on the yellow target at x=0.53 y=0.11 (metres, robot base frame): "
        "pick it, then place it there.")
OBJECTS = "objects blue_cube=(0.59,0.21) red_cube=(0.54,-0.12)"


def test_the_state_line_has_objects_only_while_the_gripper_is_empty_and_the_task_last():
    assert state_line(OBJECTS, None, GOAL, False) == f"{OBJECTS}; gripper empty; task: {task_brief(GOAL)}"
    assert state_line(OBJECTS, "red_cube", GOAL, False) == f"gripper holding red_cube; task: {task_brief(GOAL)}"
    assert state_line(OBJECTS, None, GOAL, True) == ACHIEVED
    assert state_line(OBJECTS, None, None, False) == f"{OBJECTS}; gripper empty"


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
