"""What the robot agent writes into its context, and what it can predict of it (no ROS here).

The state line restated before each decision is lean: the objects on the table only while the
gripper is empty (a held object is not on the table, and placing it needs the task's target,
not the other cubes), what the gripper holds, and the task last: SmolLM2-135M reads the task
reliably only when it comes after the state, so the goal is not a line of its own. With the
gripper empty the line carries the whole task statement (`task_brief`: without the user's steps
after the goal the model picks the right cube less often); while it holds an object the line
restates the goal alone (`goal_brief`; the whole statement is in the context already), about half
the tokens ("holding red_cube" alone makes SmolLM2-135M call hold instead of place; "carrying"
does not; the README gives the probe's figures).
Once the robot reports the task achieved, the line says only that. The robot's "done" feedback on
a call is not a line of its own either: its effect is in the next state line.

Each robot tool declares its effect on the gripper when it succeeds (`effect`: pick(x) -> holding
x, place -> empty), so while the robot executes a call the agent can write the state line it will
see when the call succeeds (`predicted_state`) and decide the next call ahead on a session
checkpoint (`EngineWorker.decide_ahead`). The prediction is made only where it does not depend on
perception (the gripper will hold something, so no object positions are in the line).

`ContextPolicy` is the agent's side of this, written without ROS so that it is tested without
rclpy: which readings enter the context and when (held back while the robot executes a call),
the state line, the tools each decision may call, and the tracking of the robot's execution from
its feedback. It takes the engine worker at construction and the node's parameters and clock
(`now_s`, `stamp_s`: seconds of the node's clock) with each call; the node wires ROS callbacks
to it.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict

from tokenspeed_ros.task import TASK_DONE, achieved

CALLS_KEPT = 256                        # published calls remembered to interpret the robot's feedback
ACHIEVED = "the robot reports the task achieved"
SENSORS = ("joint_states", "camera")    # sources that must be fresh for the engine to decide
APPLY_WAIT_S = 0.5                      # the robot answers a call it was sent ("applied", "rejected") within this (s)


def task_brief(goal: str) -> str:
    """The goal as the state line restates it before every decision: without its parenthetical
    remarks (e.g. "(metres, robot base frame)", which the system prompt already says), fewer tokens
    to prefill per decision; the goal reading stays in the context in full."""
    return re.sub(r"\s*\([^()]*\)", "", goal)


def goal_brief(goal: str) -> str:
    """The goal as the state line restates it while the gripper holds an object: `task_brief` up
    to its first ':' or the end of its first sentence (what follows is the user's steps, in the
    context since the task's first state line), its numbers without a leading zero ("x=0.53" ->
    "x=.53": SmolLM2's tokenizer writes every digit alone, and "=." is one token, so 1-2 tokens
    less each at the same rounding; the model still writes 0.53 in its call)."""
    goal = re.split(r":(?:\s|$)|\.(?=\s+[A-Z]|\s*$)", task_brief(goal), maxsplit=1)[0]
    return re.sub(r"(?<![\d.])0\.(?=\d)", ".", goal)


def effect(tool: str, arguments: dict, holding: str | None) -> str | None:
    """What the gripper holds after `tool(**arguments)` succeeds, given it holds `holding` now
    (an object name or None): pick(object) -> that object, place -> None, any other call leaves it."""
    if tool == "pick":
        return arguments.get("object") or holding
    if tool == "place":
        return None
    return holding


def state_line(objects: str, holding: str | None, goal: str | None, achieved: bool) -> str:
    """The state line: "<objects>; gripper empty; task: <task_brief>" with the gripper empty,
    "carrying <x>; <goal_brief>" while it holds x, and only "the robot reports the task
    achieved" once the robot says so (the agent then offers the completion tool alone, whose call
    the grammar fixes). objects: perception's text ("objects red_cube=(...)"); goal: the task
    text or None (then no task part)."""
    if achieved:
        return ACHIEVED
    if holding is None:
        parts = [objects, "gripper empty"] + (["task: " + task_brief(goal)] if goal else [])
    else:
        parts = [f"carrying {holding}"] + ([goal_brief(goal)] if goal else [])
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


class ContextPolicy:
    """What the robot agent writes into its engine's context, which tools each decision may
    call, and whether the robot is executing a call. Not thread-safe: the node's executor thread.

    worker: the node's EngineWorker (anything with its `observe`, `new_episode` and
    `decide_ahead`); tool_names: the names in the node's tool list (the completion tool
    included). `p` (every method): the node's current AgentParams. Times are seconds of the node's
    clock. State: `texts` (source -> newest text, sent to the engine or held back), `task` (the
    current or last task: `running`, `text`, `tools`), `status` (the robot cell's latest JSON
    status), `gripper`, and the robot's current call.
    """

    def __init__(self, worker, tool_names: list[str]):
        self.worker = worker
        self.tool_names = tool_names
        self.texts: dict[str, str] = {}
        self.task = None
        self.status: dict | None = None
        self.gripper = GripperState()
        self._held: dict[str, tuple[float, str]] = {}   # source -> (stamp_s, kind) of a reading held back
        self._state_queued: str | None = ""             # the last state line given to the engine
        self._executing: tuple[int, float] | None = None  # robot's current model call: (id, applied at)
        self._sent: tuple[int, float] | None = None       # newest moving model call, until the robot answers it
        self.first_call = False                         # the task's first call is not yet decided (`decide_first_ahead`)
        self.ahead_line: str | None = None              # the state line the first call was decided ahead on

    # ------------------------------------------------------------------ the context
    def submit(self, p, source: str, text: str, stamp_s: float, now_s: float, kind: str = "sensor") -> bool:
        """Send a changed observation to the engine; returns False when the text is unchanged.
        While the robot executes a model call, sensor readings are held back (unless
        observe_while_executing): nothing decides then, and the engine stays free for the
        decision that the call's feedback triggers; the newest one goes in after that decision."""
        if self.texts.get(source) == text:
            return False
        self.texts[source] = text
        if source in SENSORS and not p.observe_while_executing and self.robot_executing(p, now_s):
            self._held[source] = (stamp_s, kind)
        else:
            self._held.pop(source, None)
            self._send(p, source, text, stamp_s, kind)
        return True

    def _send(self, p, source: str, text: str, stamp_s: float, kind: str) -> None:
        """Give a reading to the engine. With restate_before_decisions the camera's objects and
        the goal enter the context only as part of the state line (one line, the state last), and
        every other reading except joint states is followed by the state line."""
        if not (source in ("camera", "goal") and p.restate_before_decisions):
            self.worker.observe(source, text, stamp_s, kind)
        if source != "joint_states":
            self.queue_state(p, stamp_s)

    def queue_state(self, p, stamp_s: float) -> None:
        """Stream the state line in when it changed, so that between decisions it is prefilled
        ahead of the next decision, which then restates it for free; not before the camera's first
        reading (nothing decides without it), nor while no task runs unless decide_without_task:
        nothing decides then, and the next task's new episode would drop the line, so the engine
        stays free for that task's first call instead of prefilling lines no decision reads."""
        text = self.state_text(p)
        deciding = (self.task is not None and self.task.running) or p.decide_without_task
        if p.restate_before_decisions and deciding and text != self._state_queued and "camera" in self.texts:
            self._state_queued = text
            self.worker.observe("state", text, stamp_s)

    def before_decision(self, p, stamp_s: float) -> tuple[str, str, float] | None:
        """The state line to restate right before a decision on the observation stamped
        `stamp_s` (EngineWorker.decide's `restate`; None without restate_before_decisions): queued
        readings wait behind it, and it is not prefilled again while it is the context's last
        message. Call `release_held` once the decision is requested."""
        self._state_queued = self.state_text(p)
        self.first_call, self.ahead_line = False, None
        return ("state", self._state_queued, stamp_s) if p.restate_before_decisions else None

    def decide_first_ahead(self, p) -> bool:
        """A task's first call is decided ahead on the newest camera frame's state line (the
        engine prefills it and decides while nothing is published) and goes out on the next
        frame whose state line is token for token the same (`first_ahead_hit`): that is the
        decision on that frame, exactly (same context, greedy decoding), so only that frame's
        perception and the hit lie between its capture and the command. A frame that changes the
        line while the decision ahead is not yet made replaces it (decided ahead again); once it
        is made, a changed line, or a failed decision ahead, decides afresh (a miss), so a scene
        that keeps changing still gets its call.
        Returns False (decide now) when deciding ahead is off; True without deciding while no
        camera frame came yet (the first one decides ahead)."""
        if not (p.decide_ahead and p.restate_before_decisions):
            return False
        if "camera" not in self.texts:
            return True
        self._state_queued = self.ahead_line = self.state_text(p)
        self.worker.decide_ahead(("state", self.ahead_line, 0.0), self.tool_choice(p))
        return True

    def first_call_trigger(self, p, why: str) -> str:
        """What a decision trigger `why` (see AgentNode._trigger) does while the task's first call
        is not yet decided: "wait" (the first frame is decided ahead, and a changed frame again
        while that is not done yet; other triggers wait for the frame after it), "afresh" (the
        decision ahead failed or was on another state line: decide now, a miss) or "" (no first
        call pending, or a "frame" hit: decide now)."""
        if not self.first_call or why == "frame":
            return ""
        pending = self.ahead_line is not None and self.worker.ahead_pending
        if self.ahead_line is None or (pending and why == "scene"):
            return "wait" if self.decide_first_ahead(p) else ""
        return "wait" if pending else "afresh"

    def first_ahead_hit(self, p) -> bool:
        """The task's first call was decided ahead on exactly the current state line."""
        return self.first_call and self.ahead_line == self.state_text(p) and self.worker.decided_ahead is not None

    def release_held(self, p) -> None:
        """Queue the newest held-back readings (the engine prefills them after a pending decision)."""
        held, self._held = self._held, {}
        for source, (stamp_s, kind) in held.items():
            self._send(p, source, self.texts[source], stamp_s, kind)

    def start_task(self, p, task, now_s: float) -> bool:
        """Make `task` the current one (the caller ended the last one) and start a new episode of
        the context (`EngineWorker.new_episode`): the system prompt and tools, then the goal (even
        the same text as the last task's) and the current readings. Returns True when the goal
        went in (a decision may follow)."""
        self.task = task
        self.worker.new_episode()
        self.first_call, self.ahead_line = True, None
        self.texts.pop("goal", None)
        self._state_queued = None
        submitted = self.submit(p, "goal", f"goal: {task.text}", now_s, now_s, kind="text")
        for source in SENSORS:
            if source in self.texts:
                self._send(p, source, self.texts[source], now_s, "sensor")
        return submitted

    def on_status(self, p, status: dict, now_s: float) -> str | None:
        """The robot cell's new status; returns the evidence when it newly reports the running
        task achieved (the state line then says so)."""
        was = achieved(self.status)
        self.status = status
        evidence = achieved(status)
        if self.task is not None and self.task.running and evidence and not was:
            self.queue_state(p, now_s)
            return evidence
        return None

    # ------------------------------------------------------------------ state and tools
    def goal(self) -> str | None:
        """The current task's text as it entered the context, or None."""
        goal = self.texts.get("goal")
        return goal.removeprefix("goal: ") if goal else None

    def state_text(self, p) -> str:
        """The state line restated before each decision (`state_line`)."""
        return state_line(self.texts.get("camera", "objects unknown"), self.gripper.holding, self.goal(),
                          self.task is not None and self.task.running and self.done_evidence(p) is not None)

    def done_evidence(self, p, holding: str | None | bool = False) -> str | None:
        """Why the task counts as achieved now (the robot cell's status, or with no status topic
        an empty gripper: `holding`, False = what it holds now), or None."""
        if p.task_status_topic:
            return achieved(self.status)
        return "the gripper is empty" if self._holding(holding) is None else None

    def _holding(self, holding: str | None | bool) -> str | None:
        """`holding` as given, or what the gripper holds now when it is False."""
        return self.gripper.holding if holding is False else holding

    def state_tools(self, p, wanted: list[str], holding: str | None | bool = False) -> list[str]:
        """The tools a decision may call in the gripper's state (tools_when_empty /
        tools_when_holding, empty = every tool but the completion tool), within `wanted` when
        given (a goal's or a request's tools); [] when none is left (nothing could decide).
        holding: the gripper's state to choose for (False: the current one)."""
        holding = self._holding(holding)
        names = p.tools_when_empty if holding is None else p.tools_when_holding
        names = [n for n in names or self.tool_names if n != TASK_DONE]
        return [n for n in names if n in wanted] if wanted else names

    def refusal(self, p, tools: list[str]) -> str | None:
        """Why a request to decide with `tools` (a RunTask goal's or a Decide request's; [] = the
        configured subsets) could never decide now: unknown tool names, or none of them may be
        called in the gripper's state; None when it can."""
        unknown = [t for t in tools if t not in self.tool_names]
        if unknown:
            return f"unknown tools {unknown}"
        if p.tool_choice in ("required", "auto") and not self.state_tools(p, tools):
            return f"none of the tools {tools} may be called with the {self.gripper.text()}"
        return None

    def tool_choice(self, p, tools: list[str] | None = None, holding: str | None | bool = False):
        """decide()'s tool_choice: only the completion tool while a task runs and the robot
        reports it achieved; else `tools` (a Decide request's), or the task's tools, or the
        tools_when_empty / tools_when_holding subset for the gripper state, in OpenAI's
        allowed_tools form (mode = the tool_choice parameter; an empty subset = every tool but
        the completion tool); or the one tool tool_choice names. holding: the gripper's state to
        choose for (False: the current one)."""
        holding = self._holding(holding)
        if self.task is not None and self.task.running and self.done_evidence(p, holding) is not None:
            names = [TASK_DONE]
        elif p.tool_choice not in ("required", "auto"):
            return {"name": p.tool_choice}
        else:
            names = self.state_tools(p, tools or (self.task.tools if self.task is not None else []), holding)
        return {"type": "allowed_tools", "allowed_tools": {
            "mode": "required" if names == [TASK_DONE] else p.tool_choice,
            "tools": [{"type": "function", "function": {"name": n}} for n in names]}}

    # ------------------------------------------------------------------ the robot's execution
    def robot_executing(self, p, now_s: float) -> bool:
        """The robot is executing a model call: it applied one that has not ended (for at most
        execution_timeout_s), or it has not yet answered the newest one sent (for at most
        APPLY_WAIT_S: a decision triggered right after a call goes out must not preempt it)."""
        if p.decide_while_executing:
            return False
        if self._sent is not None and now_s - self._sent[1] < APPLY_WAIT_S:
            return True
        return self._executing is not None and now_s - self._executing[1] < p.execution_timeout_s

    def on_published(self, p, decision_id: int, tool: str, arguments_json: str, source: str, now_s: float) -> None:
        """A command went to the robot: remember the call for the gripper state; for the model's
        moving call (with robot feedback on), wait for the robot's answer and decide the next
        call ahead on the state line its success leads to (when that line is predictable:
        `predicted_state`; with decide_ahead, while a task runs)."""
        self.gripper.sent(decision_id, tool, arguments_json)
        if source != "model" or tool in ("hold", "stop") or not p.action_feedback_topic:
            return
        self._sent = (decision_id, now_s)
        if not p.decide_ahead or self.task is None or not self.task.running:
            return
        tool, arguments = self.gripper.call(decision_id) or (tool, {})
        predicted = predicted_state(tool, arguments, self.gripper.holding, self.goal())
        if predicted is not None:
            text, holding = predicted
            self.worker.decide_ahead(("state", text, 0.0), self.tool_choice(p, holding=holding))

    def on_feedback(self, p, decision_id: int, tool: str, state: str, detail: str, now_s: float) -> bool:
        """One ActionFeedback from the robot: track which call it executes and tell the model how
        its calls ended ("robot: pick rejected (...) (decision 7)"; a call done shows in the state
        line). Returns True when the call it was executing ended (a decision may follow)."""
        moving = tool not in ("hold", "stop")
        self.gripper.feedback(decision_id, tool, state, detail)
        if self._sent is not None and decision_id == self._sent[0]:
            self._sent = None
        if state == "applied":
            self._executing = (decision_id, now_s) if moving else None
            return False
        if moving and not (state == "done" and "fail" not in detail):
            more = f" ({detail})" if detail and detail != "ok" else ""
            self.submit(p, "robot", f"robot: {tool} {state}{more} (decision {decision_id})", now_s, now_s)
        if self._executing is not None and decision_id == self._executing[0]:
            self._executing = None
            return True
        return False
