"""What the robot agent writes into its context, and what it can predict of it (no ROS here).

The state line restated before each decision is lean: the objects on the table only while the
gripper is empty (a held object is not on the table, and placing it needs the task's target,
not the other cubes), what the gripper holds, and the task last: SmolLM2-135M reads the task
reliably only when it comes after the state, so the goal is not a line of its own. Once the
robot reports the task achieved, the line says only that. The robot's "done" feedback on a call
is not a line of its own either: its effect is in the next state line.

Each robot tool declares its effect on the gripper when it succeeds (`effect`: pick(x) -> holding
x, place -> empty), so while the robot executes a call the agent can write the state line it will
see when the call succeeds (`predicted_state`) and decide the next call ahead on a session
checkpoint (`EngineWorker.decide_ahead`). The prediction is made only where it does not depend on
perception (the gripper will hold something, so no object positions are in the line).
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict

CALLS_KEPT = 256                        # published calls remembered to interpret the robot's feedback
ACHIEVED = "the robot reports the task achieved"


def task_brief(goal: str) -> str:
    """The goal as the state line restates it before every decision: without its parenthetical
    remarks (e.g. "(metres, robot base frame)", which the system prompt already says), fewer tokens
    to prefill per decision; the goal reading stays in the context in full."""
    return re.sub(r"\s*\([^()]*\)", "", goal)


def effect(tool: str, arguments: dict, holding: str | None) -> str | None:
    """What the gripper holds after `tool(**arguments)` succeeds, given it holds `holding` now
    (an object name or None): pick(object) -> that object, place -> None, any other call leaves it."""
    if tool == "pick":
        return arguments.get("object") or holding
    if tool == "place":
        return None
    return holding


def state_line(objects: str, holding: str | None, goal: str | None, achieved: bool) -> str:
    """The state line: "<objects>; gripper empty; task: <brief>" with the gripper empty,
    "gripper holding <x>; task: <brief>" while it holds x, and only "the robot reports the task
    achieved" once the robot says so (the agent then offers the completion tool alone, whose call
    the grammar fixes). objects: perception's text ("objects red_cube=(...)"); goal: the task
    text or None (then no task part)."""
    if achieved:
        return ACHIEVED
    parts = [objects, "gripper empty"] if holding is None else [f"gripper holding {holding}"]
    if goal:
        parts.append("task: " + task_brief(goal))
    return "; ".join(parts)


def predicted_state(tool: str, arguments: dict, holding: str | None, goal: str | None) -> tuple[str, str | None] | None:
    """(the state line, what the gripper holds) once the robot's call `tool(**arguments)` has
    succeeded, when that line can be known now: the gripper will hold something (the line then
    has no object positions) and the task is not yet reported achieved; else None."""
    after = effect(tool, arguments, holding)
    if after is None:
        return None
    return state_line("", after, goal, achieved=False), after


class GripperState:
    """What the gripper holds, from the robot's feedback on the agent's own calls.

    Feedback names only the decision, so `sent()` records each published call (decision id ->
    tool and arguments) and `feedback()` applies the robot's reports: a call "done" -> its
    declared `effect` (a pick whose detail says the grasp failed changes nothing); a pick
    rejected because the gripper is "already holding X" -> holding X; a place rejected for "not
    holding" -> empty (the robot's own word corrects a missed event). Feedback is exact in time
    and names the object, which finger positions cannot (a closed gripper does not say which
    cube it holds, and is ambiguous while the fingers move). Not thread-safe (executor thread).
    """

    def __init__(self, holding: str | None = None):
        self.holding: str | None = holding        # object name, or None when empty
        self._calls: OrderedDict[int, tuple[str, dict]] = OrderedDict()

    def sent(self, decision_id: int, tool: str, arguments_json: str) -> None:
        """Record a call published to the robot (arguments as JSON text)."""
        try:
            arguments = json.loads(arguments_json or "{}")
        except json.JSONDecodeError:
            arguments = {}
        self._calls[decision_id] = (tool, arguments if isinstance(arguments, dict) else {})
        while len(self._calls) > CALLS_KEPT:
            self._calls.popitem(last=False)

    def call(self, decision_id: int) -> tuple[str, dict] | None:
        """(tool, arguments) of a recorded call, or None."""
        return self._calls.get(decision_id)

    def feedback(self, decision_id: int, tool: str, state: str, detail: str) -> bool:
        """Apply one ActionFeedback (state "applied", "done", "preempted" or "rejected");
        returns True when what the gripper holds changed."""
        before = self.holding
        if state == "done" and not (tool == "pick" and "fail" in detail):
            _, arguments = self._calls.get(decision_id, (tool, {}))
            self.holding = effect(tool, arguments, self.holding)
        elif state == "rejected" and tool == "pick":
            held = re.search(r"already holding (\w+)", detail)
            self.holding = held.group(1) if held else self.holding
        elif state == "rejected" and tool == "place" and "not holding" in detail:
            self.holding = None
        return self.holding != before

    def text(self) -> str:
        """"gripper empty" or "gripper holding <object>"."""
        return "gripper empty" if self.holding is None else f"gripper holding {self.holding}"
