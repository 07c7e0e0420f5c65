"""`tokenspeed_agent`: the ROS 2 node that runs an LLM agent on a robot arm under a deadline monitor.

Inputs: joint states and camera images (+ CameraInfo and the camera pose) become compact text
observations (`inputs`, `perception`) streamed into a resident tokenspeed Session on the engine
thread (`engine_worker`); an optional goal topic adds the task. Decisions are triggered at a fixed
rate and on events (new goal, changed scene, the robot finishing or rejecting the last call), one
at a time; while the robot executes a model call, rate and scene triggers wait for its feedback.
Each decision's deadline is measured from the newest sensor stamp.

It is a managed (lifecycle) node (`managed_node`): configure loads the model, activate starts
decisions, deactivate publishes the safe fallback. Tasks arrive as `RunTask` action goals (or on
the goal topic) and end when the model calls the completion tool `task_done`, offered only while
the robot's status reports the goal achieved (`task`); `Decide` makes one decision on demand.

The node tracks what the gripper holds from the robot's ActionFeedback (`GripperState`) and
masks actions by precondition: each decision may only call the tools configured for the current
state (`tools_when_empty` / `tools_when_holding`, OpenAI allowed_tools). Right before each
decision it streams a lean state line into the context (`context_policy`: "objects ...; gripper
empty; task: ..." or "gripper holding red_cube; task: ..."), so a small model reads the state and
the task last; while the robot executes a call, the next call is decided ahead on the state the
call's success leads to (`EngineWorker.decide_ahead`), and a task's first call is decided ahead on
the newest camera frame and published on the next frame with the same state line. Every decision's stages go out as JSON on
`<action_topic>/trace` (`decision_trace`). The `DeadlineMonitor` publishes
each valid, timely tool call as an `ActionCommand` (plus a `PoseStamped` target for calls with a
position) and the safe fallback otherwise. Bad input is counted and dropped; missing sensors or a
missing engine give fallbacks. Counts and latency percentiles go to /diagnostics.

Run: `tokenspeed_agent --ros-args --params-file tokenspeed_ros/config/agent.yaml`.
"""
from __future__ import annotations

import json
import math
import sys
import time

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import PoseStamped
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.duration import Duration
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rclpy.time import Time
from sensor_msgs.msg import CameraInfo, Image, JointState
from std_msgs.msg import String
from tokenspeed_msgs.action import RunTask
from tokenspeed_msgs.msg import ActionCommand, ActionFeedback, DeadlineStatus, Observation
from tokenspeed_msgs.srv import Decide

from tokenspeed_ros.context_policy import GripperState, predicted_state, state_line
from tokenspeed_ros.deadline_monitor import DeadlineMonitor, ModelResult
from tokenspeed_ros.decision_trace import TraceStats, trace_record
from tokenspeed_ros.decision_loop import DecisionLoop
from tokenspeed_ros.engine_worker import EngineWorker, Observed, run_engine_node
from tokenspeed_ros.inputs import BadInput, InputHealth, check_stamp, image_to_rgb, joint_state_text
from tokenspeed_ros.managed_node import ConfigureError, ManagedNode
from tokenspeed_ros.params import AgentParams, AgentParamsError
from tokenspeed_ros.perception import CameraModel, locate_cubes, objects_text
from tokenspeed_ros.task import CANCELLED, DONE, FAILED, TASK_DONE, TASK_DONE_TOOL, Task, achieved, parse_status

SENSORS = ("joint_states", "camera")    # sources that must be fresh for the engine to decide
TRACES_PENDING = 64                     # decisions whose reading times are kept until the engine answers
APPLY_WAIT_S = 0.5                      # the robot answers a call it was sent ("applied", "rejected") within this (s)


def target_pose(arguments: dict, frame_id: str, default_z: float) -> PoseStamped | None:
    """The gripper target of a tool call with a position (move_to, place: "x", "y" and optional
    "z", metres in `frame_id`; `default_z` when there is no "z"), pointing down; None for calls
    without a position. The stamp is left for the caller."""
    if not isinstance(arguments, dict) or "x" not in arguments or "y" not in arguments:
        return None
    pose = PoseStamped()
    pose.header.frame_id = frame_id
    p = pose.pose.position
    p.x, p.y, p.z = float(arguments["x"]), float(arguments["y"]), float(arguments.get("z", default_z))
    pose.pose.orientation.x, pose.pose.orientation.w = 1.0, 0.0      # 180 deg about x: gripper down
    return pose


class AgentNode(ManagedNode):
    """The agent node, a managed (lifecycle) node: see `ManagedNode` for the transitions and
    `AgentParams` for the parameters. Raises AgentParamsError at construction on bad parameters;
    a bad tool file or model fails configure; everything after that is handled without raising."""

    PARAMS = AgentParams

    def __init__(self, **node_kwargs):
        self.worker: EngineWorker | None = None     # from configure to cleanup
        self.monitor: DeadlineMonitor | None = None  # made at configure, closed at cleanup
        self.task: Task | None = None               # the current or last task
        self._task_server: ActionServer | None = None
        self._task_handles: dict[int, object] = {}  # id(task) -> its RunTask goal handle, until answered
        super().__init__("tokenspeed_agent", **node_kwargs)

    def configure(self) -> None:
        """Topics, deadline monitor, timers; compiles the tools and loads the model (waits for
        it). Raises AgentParamsError (also for the tool file) or ConfigureError (the model did not load)."""
        p = self.p
        tools = p.load_tools()
        if TASK_DONE not in [t["function"]["name"] for t in tools]:
            tools.append(TASK_DONE_TOOL)
        self._tool_names = [t["function"]["name"] for t in tools]
        p.check_tool_names(self._tool_names)
        self.health = InputHealth(self.get_logger())
        self._camera_info: CameraInfo | None = None
        self._camera_pose: PoseStamped | None = None
        self._camera: CameraModel | None = None     # built when both of the above are valid
        self._started = self.get_clock().now()
        self._last_rx: dict[str, Time] = {}         # source -> node time of the last valid message
        self._latest_stamp: Time | None = None      # newest valid sensor stamp
        self._latest_times = (0.0, 0.0)             # its message's (received, perceived) wall times
        self._traced: dict[int, dict] = {}          # decision id -> node times of its reading, until resolved
        self.traces = TraceStats()
        self._texts: dict[str, str] = {}            # source -> newest text (sent to the engine, or held)
        self._held: dict[str, tuple[Time, str]] = {}  # source -> (stamp, kind) of a reading held back
        self._state_queued = ""                     # the last state line given to the engine
        self._first_call = False                    # the task's first call is not yet decided (see _decide_first_ahead)
        self._superseded: int | None = None         # the decision in flight when the current task started
        self._ahead_line: str | None = None         # the state line it was decided ahead on
        self._executing: tuple[int, Time] | None = None    # robot's current model call: (id, applied at)
        self._sent: tuple[int, Time] | None = None         # newest moving model call, until the robot answers it
        self._skipped_busy = 0
        self._skipped_executing = 0
        self._diag_seen_bad = 0
        self.gripper = GripperState()
        self.task = None
        self._status: dict | None = None            # the robot cell's latest status (task_status_topic)
        self._decide_outcome: tuple | None = None   # (DeadlineStatus, ActionCommand) of the latest outcome

        self.monitor = DeadlineMonitor(
            self, action_topic=p.action_topic, status_topic=p.deadline_status_topic,
            budget_s=p.deadline_budget_s, fallback=p.fallback, period_s=p.monitor_period_s,
            qos_depth=p.command_qos_depth, qos_deadline_s=p.command_qos_deadline_s, on_outcome=self._on_outcome,
            active=lambda: self.active, frame_id=p.base_frame)
        self._obs_pub = self.create_publisher(Observation, p.observation_topic, 10)
        self._pose_pub = self.create_publisher(PoseStamped, p.target_pose_topic, 10)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._trace_pub = self.create_publisher(String, p.action_topic + "/trace", 10)

        sensor_qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT
                                if p.sensor_reliability == "best_effort" else ReliabilityPolicy.RELIABLE)
        self.create_subscription(JointState, p.joint_states_topic, self._on_joint_state, sensor_qos)
        self.create_subscription(Image, p.image_topic, self._on_image, sensor_qos)
        self.create_subscription(CameraInfo, p.camera_info_topic, self._on_camera_info, sensor_qos)
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.create_subscription(PoseStamped, p.camera_pose_topic, self._on_camera_pose, latched)
        if p.goal_topic:
            self.create_subscription(String, p.goal_topic, self._on_goal, latched)
        if p.action_feedback_topic:
            self.create_subscription(ActionFeedback, p.action_feedback_topic, self._on_feedback, 50)
        if p.task_status_topic:
            self.create_subscription(String, p.task_status_topic, self._on_task_status, latched)

        self._wake = self.create_guard_condition(lambda: self.loop.on_engine_output())
        self.worker = EngineWorker(model=p.model, threads=p.threads, quantize=p.quantize,
                                   device=p.device, dtype=p.dtype, system=p.system_prompt, tools=tools,
                                   tool_choice=self._tool_choice(), kv_budget=p.kv_budget_tokens,
                                   notify=self._wake.trigger, logger=self.get_logger(),
                                   repeat_slack=p.restate_slack_tokens, replace_sources=("state",))
        self.loop = DecisionLoop(self.monitor, self.worker, self.get_clock(), publish_margin_s=p.publish_margin_s,
                                 on_observed=self._echo_observation, check_result=self._check_result,
                                 on_resolved=self._on_resolved)
        self._rate_timer = None
        self._set_rate_timer(p.decision_period_s)
        self._diag_timer = self.create_timer(p.diagnostics_period_s, self._publish_diagnostics)
        self.worker.start()
        if self.worker.wait_loaded() != "ready":
            raise ConfigureError(f"the model did not load: {self.worker.fault}")
        # the action server and the service appear once the model is loaded
        if p.run_task_action:
            # goals are executed through goal_handle.execute(callback) when their task ends (see
            # _on_task_accepted); rclpy requires a default callback, which is never used
            self._task_server = ActionServer(self, RunTask, p.run_task_action, execute_callback=lambda _: None,
                                             goal_callback=self._on_task_goal, cancel_callback=self._on_task_cancel,
                                             handle_accepted_callback=self._on_task_accepted)
        if p.decide_service:
            self.create_service(Decide, p.decide_service, self._on_decide)
        self.get_logger().info(f"tokenspeed_agent configured: budget {p.deadline_budget_s} s, fallback {p.fallback}, "
                               f"decision period {p.decision_period_s} s, model {p.model or 'embedded'}")

    def deactivate(self) -> None:
        """The safe fallback goes out (for the decision in progress, or on its own) and nothing
        decides until activate."""
        self.loop.stop(self._latest_stamp or self.get_clock().now(), "deactivated")

    def cleanup(self, timeout_s: float = 1.0) -> bool:
        """End the task, remove the action server, stop the deadline monitor's thread and the
        engine thread (see ManagedNode.cleanup)."""
        if self.task is not None:
            self.task.finish(CANCELLED, "the node was cleaned up")
        if self._task_server is not None:
            self._task_server.destroy()
            self._task_server = None
        if self.monitor is not None:
            self.monitor.close()
        worker, self.worker = self.worker, None
        return worker.close(timeout_s) if worker is not None else True

    def apply_live(self, new: AgentParams, changed: set[str]) -> None:
        """Apply live parameters (AgentParams.LIVE) to the running node."""
        if {"tools_when_empty", "tools_when_holding", "tool_choice"} & changed:
            new.check_tool_names(self._tool_names)
        if "deadline_budget_s" in changed:
            self.monitor.budget = Duration(seconds=new.deadline_budget_s)
        self.monitor.fallback = new.fallback
        self.monitor.frame_id = new.base_frame
        self.loop.publish_margin_s = new.publish_margin_s
        self.worker.set_repeat_slack(new.restate_slack_tokens)
        if "threads" in changed:
            self.worker.set_threads(new.threads)
        if "decision_period_s" in changed:
            self._set_rate_timer(new.decision_period_s)
        if "diagnostics_period_s" in changed:
            self.destroy_timer(self._diag_timer)
            self._diag_timer = self.create_timer(new.diagnostics_period_s, self._publish_diagnostics)

    def _set_rate_timer(self, period_s: float) -> None:
        if self._rate_timer is not None:
            self.destroy_timer(self._rate_timer)
            self._rate_timer = None
        if period_s > 0:
            self._rate_timer = self.create_timer(period_s, lambda: self._trigger("rate"))

    # ------------------------------------------------------------------ inputs
    def _stamp(self, stamp) -> Time:
        now = self.get_clock().now()
        check_stamp(stamp, now.nanoseconds * 1e-9, self.p.max_future_s, self.p.max_age_s)
        return Time.from_msg(stamp, clock_type=now.clock_type)

    def _received(self, source: str, stamp: Time, received: float) -> None:
        """A valid reading stamped `stamp`, whose message arrived at `received` (wall clock, s),
        is processed (perception done)."""
        self._last_rx[source] = self.get_clock().now()
        if self._latest_stamp is None or stamp > self._latest_stamp:
            self._latest_stamp = stamp
            self._latest_times = (received, time.time())

    def _submit(self, source: str, text: str, stamp: Time, kind: str = "sensor") -> bool:
        """Send a changed observation to the engine; returns False when the text is unchanged.
        While the robot executes a model call, sensor readings are held back (unless
        observe_while_executing): nothing decides then, and the engine stays free for the
        decision that the call's feedback triggers; the newest one goes in after that decision."""
        if self._texts.get(source) == text:
            return False
        self._texts[source] = text
        if source in SENSORS and not self.p.observe_while_executing and self._robot_executing():
            self._held[source] = (stamp, kind)
        else:
            self._held.pop(source, None)
            self._send(source, text, stamp, kind)
        return True

    def _send(self, source: str, text: str, stamp: Time, kind: str) -> None:
        """Give a reading to the engine. With restate_before_decisions the camera's objects and
        the goal enter the context only as part of the state line (one line, the state last), and
        every other reading except joint states is followed by the state line."""
        if not (source in ("camera", "goal") and self.p.restate_before_decisions):
            self.worker.observe(source, text, stamp.nanoseconds * 1e-9, kind)
        if source != "joint_states":
            self._queue_state(stamp)

    def _queue_state(self, stamp: Time) -> None:
        """Stream the state line in when it changed, so that between decisions it is prefilled
        ahead of the next decision, which then restates it for free (not before the camera's first
        reading: nothing decides without it)."""
        text = self._state_text()
        if self.p.restate_before_decisions and text != self._state_queued and "camera" in self._texts:
            self._state_queued = text
            self.worker.observe("state", text, stamp.nanoseconds * 1e-9)

    def _release_held(self) -> None:
        """Queue the newest held-back readings (the engine prefills them after a pending decision)."""
        held, self._held = self._held, {}
        for source, (stamp, kind) in held.items():
            self._send(source, self._texts[source], stamp, kind)

    def _on_joint_state(self, msg: JointState) -> None:
        received = time.time()
        try:
            stamp = self._stamp(msg.header.stamp)
            text = joint_state_text(msg)
        except BadInput as e:
            self.health.report(e, self.p.joint_states_topic)
            return
        self._received("joint_states", stamp, received)
        if self.p.joint_states_in_context:
            self._submit("joint_states", text, stamp)

    def _on_camera_info(self, msg: CameraInfo) -> None:
        old = self._camera_info
        if old is None or (list(old.k), old.width, old.height) != (list(msg.k), msg.width, msg.height):
            self._update_camera(msg, self._camera_pose, self.p.camera_info_topic)

    def _on_camera_pose(self, msg: PoseStamped) -> None:
        self._update_camera(self._camera_info, msg, self.p.camera_pose_topic)

    def _update_camera(self, info: CameraInfo | None, pose: PoseStamped | None, topic: str) -> None:
        try:
            camera = None if info is None or pose is None else CameraModel.from_msgs(info, pose.pose)
        except BadInput as e:
            self.health.report(e, topic)
            return
        self._camera_info, self._camera_pose, self._camera = info, pose, camera

    def _on_image(self, msg: Image) -> None:
        received = time.time()
        try:
            stamp = self._stamp(msg.header.stamp)
            rgb = image_to_rgb(msg)
            if self._camera is None:
                raise BadInput("no_camera_model", f"no valid {self.p.camera_info_topic} and "
                                                  f"{self.p.camera_pose_topic} yet")
            objects = locate_cubes(rgb, self._camera, self.p.object_plane_z, self.p.min_blob_area_px)
        except BadInput as e:
            self.health.report(e, self.p.image_topic)
            return
        self._received("camera", stamp, received)
        if self._submit("camera", objects_text(objects), stamp) and self.p.decide_on_scene_change:
            self._trigger("scene")
        elif self._ahead_line == self._state_text() and self.worker.decided_ahead is not None:   # a hit
            self._trigger("frame")

    def _on_goal(self, msg: String) -> None:
        """The goal topic, the thin way in (off unless goal_topic is set): a new text starts a
        task (without feedback or result); the same text again (a latched re-delivery) changes
        nothing; it never preempts a running RunTask goal (ignored, with a warning)."""
        if self.task is not None and self.task.running and id(self.task) in self._task_handles:
            self.get_logger().warning(f"goal topic ignored: a RunTask goal is running ({self.task.text!r})",
                                      throttle_duration_sec=5.0)
            return
        text = msg.data.strip()
        if not text or len(text) > self.p.max_goal_chars:
            self.health.report(BadInput("goal_invalid", f"{len(text)} characters (1..{self.p.max_goal_chars})"),
                               self.p.goal_topic)
            return
        if self.task is None or self.task.text != text:
            self._start_task(Task(text, self.get_clock().now()))

    def _start_task(self, task: Task) -> None:
        """Make `task` the current one (a running one is cancelled), start a new episode of the
        context (`EngineWorker.new_episode`) and decide on it."""
        if self.task is not None:
            self.task.finish(CANCELLED, "replaced by a new task")
        self.task = task
        self.get_logger().info(f"task: {task.text}")
        # the context starts again from the system prompt and tools, then the goal (even the same
        # text as the last task's) and the current readings
        self._superseded = self.loop.outstanding
        self.worker.new_episode()
        self._texts.pop("goal", None)
        self._state_queued = None
        self._first_call, self._ahead_line = True, None
        now = self.get_clock().now()
        submitted = self._submit("goal", f"goal: {task.text}", now, kind="text")
        for source in SENSORS:
            if source in self._texts:
                self._send(source, self._texts[source], now, "sensor")
        if submitted and self.p.decide_on_goal:
            self._trigger("goal")

    def _on_task_status(self, msg: String) -> None:
        status = parse_status(msg.data)
        if status is None:
            self.health.report(BadInput("status_invalid", "not a JSON object"), self.p.task_status_topic)
            return
        was = achieved(self._status)
        self._status = status
        if self.task is not None and self.task.running and achieved(status) and not was:
            self.get_logger().info(f"the robot reports the task achieved: {achieved(status)}")
            self._queue_state(self.get_clock().now())

    def _on_feedback(self, msg: ActionFeedback) -> None:
        """Track which call the robot is executing (its end triggers a decision) and tell the
        model how its calls ended ("robot: pick done (decision 7)", "robot: place rejected (...)")."""
        moving = msg.tool_name not in ("hold", "stop")
        if self.gripper.feedback(msg.decision_id, msg.tool_name, msg.state, msg.detail):
            self.get_logger().info(f"{self.gripper.text()} (decision {msg.decision_id} {msg.tool_name} {msg.state})")
        if self._sent is not None and msg.decision_id == self._sent[0]:
            self._sent = None
        if msg.state == "applied":
            self._executing = (msg.decision_id, self.get_clock().now()) if moving else None
            return
        if moving and not (msg.state == "done" and "fail" not in msg.detail):    # else in the state line
            detail = f" ({msg.detail})" if msg.detail and msg.detail != "ok" else ""
            self._submit("robot", f"robot: {msg.tool_name} {msg.state}{detail} (decision {msg.decision_id})",
                         self.get_clock().now())
        if self._executing is not None and msg.decision_id == self._executing[0]:
            self._executing = None
            self._trigger("feedback")

    def _robot_executing(self) -> bool:
        """The robot is executing a model call: it applied one that has not ended (for at most
        execution_timeout_s), or it has not yet answered the newest one sent (for at most
        APPLY_WAIT_S: a decision triggered right after a call goes out must not preempt it)."""
        if self.p.decide_while_executing:
            return False
        now = self.get_clock().now()
        if self._sent is not None and (now - self._sent[1]).nanoseconds * 1e-9 < APPLY_WAIT_S:
            return True
        return self._executing is not None and (now - self._executing[1]).nanoseconds * 1e-9 < self.p.execution_timeout_s

    # ------------------------------------------------------------------ decisions
    def _tool_choice(self, tools: list[str] | None = None, holding: str | None | bool = False):
        """decide()'s tool_choice: only the completion tool while a task runs and the robot
        reports it achieved; else `tools` (a Decide request's), or the task's tools, or the
        tools_when_empty / tools_when_holding subset for the gripper state, in OpenAI's
        allowed_tools form (mode = the tool_choice parameter; an empty subset = every tool but
        the completion tool); or the one tool tool_choice names. holding: the gripper's state to
        choose for (False: the current one)."""
        holding = self.gripper.holding if holding is False else holding
        if self.task is not None and self.task.running and self._done_evidence(holding) is not None:
            names = [TASK_DONE]
        elif self.p.tool_choice not in ("required", "auto"):
            return {"name": self.p.tool_choice}
        else:
            names = self._state_tools(tools or (self.task.tools if self.task is not None else []), holding)
        return {"type": "allowed_tools", "allowed_tools": {
            "mode": "required" if names == [TASK_DONE] else self.p.tool_choice,
            "tools": [{"type": "function", "function": {"name": n}} for n in names]}}

    def _state_tools(self, wanted: list[str], holding: str | None | bool = False) -> list[str]:
        """The tools a decision may call in the gripper's state (tools_when_empty /
        tools_when_holding, empty = every tool but the completion tool), within `wanted` when
        given (a goal's or a request's tools); [] when none is left (nothing could decide).
        holding: the gripper's state to choose for (False: the current one)."""
        holding = self.gripper.holding if holding is False else holding
        names = self.p.tools_when_empty if holding is None else self.p.tools_when_holding
        names = [n for n in names or self._tool_names if n != TASK_DONE]
        return [n for n in names if n in wanted] if wanted else names

    def _done_evidence(self, holding: str | None | bool = False) -> str | None:
        """Why the task counts as achieved now (the robot cell's status, or with no status topic
        an empty gripper: `holding`, False = what it holds now), or None."""
        if self.p.task_status_topic:
            return achieved(self._status)
        return "the gripper is empty" if (self.gripper.holding if holding is False else holding) is None else None

    def _goal(self) -> str | None:
        goal = self._texts.get("goal")
        return goal.removeprefix("goal: ") if goal else None

    def _state_text(self) -> str:
        """The state line restated before each decision (`context_policy.state_line`)."""
        return state_line(self._texts.get("camera", "objects unknown"), self.gripper.holding, self._goal(),
                          self.task is not None and self.task.running and self._done_evidence() is not None)

    def _decide_ahead(self, cmd: ActionCommand) -> None:
        """While the robot executes the model's call `cmd`, decide the next call on the state line
        its success leads to (when that line is predictable: `context_policy.predicted_state`)."""
        if not self.p.decide_ahead or self.task is None or not self.task.running:
            return
        tool, arguments = self.gripper.call(cmd.decision_id) or (cmd.tool_name, {})
        predicted = predicted_state(tool, arguments, self.gripper.holding, self._goal())
        if predicted is not None:
            text, holding = predicted
            self.worker.decide_ahead(("state", text, 0.0), self._tool_choice(holding=holding))

    def _missing_sensors(self) -> list[str]:
        now = self.get_clock().now()
        missing = []
        for source in SENSORS:
            last = self._last_rx.get(source)
            silent_s = (now - (last or self._started)).nanoseconds * 1e-9
            if silent_s > self.p.stale_after_s:
                self.health.report(BadInput(f"missing_{source}", f"no valid data for {silent_s:.1f} s"), source)
            if last is None or silent_s > self.p.stale_after_s:
                missing.append(source)
        return missing

    def _trigger(self, why: str) -> None:
        """Start a decision now if the engine is free. `why`: "rate", "scene", "goal", "frame"
        (an unchanged camera frame for a task's first call decided ahead: `_decide_first_ahead`) or
        "feedback"; one that finds the engine busy runs when it is free, as what it was. Only
        a goal decides while the robot executes a model call. Rate triggers also keep safe
        actions flowing while the engine is stuck past a deadline. Nothing decides while the
        node is not active."""
        if not self.active:
            return
        now = self.get_clock().now()
        stamp = self._latest_stamp or now
        if self.task is not None:
            over = self.task.over_budget(now) if self.task.running else None
            if over is not None:
                self._end_task(FAILED, over)
            if not self.task.running:       # done, failed or cancelled: the agent stops acting
                return
        if why != "goal" and self._robot_executing():     # a new task may preempt the robot; nothing else
            self._skipped_executing += 1
            return
        if self.loop.busy:
            if why == "rate" and not self.monitor.is_pending(self.loop.outstanding):
                self.monitor.fail_now(stamp, "engine_busy")
            else:
                if why != "rate":
                    self.loop.defer(lambda: self._trigger(why))
                self._skipped_busy += 1
            return
        if self._missing_sensors():
            self.monitor.fail_now(stamp, "no_sensor_data")
            return
        if self._first_call and why != "frame":
            # the first frame decides ahead; a changed frame while that is not done yet, again;
            # other triggers meanwhile wait for the frame after it
            pending = self._ahead_line is not None and self.worker.ahead_pending
            if self._ahead_line is None or (pending and why == "scene"):
                if self._decide_first_ahead():
                    return
            elif pending:
                return
            else:
                self.get_logger().info(f"task's first call decided afresh on a {why} trigger (decided ahead: "
                                       f"{'none' if self.worker.decided_ahead is None else 'another state line'})")
        self._decide(stamp)

    def _decide_first_ahead(self) -> bool:
        """A task's first call is decided ahead on the newest camera frame's state line (the
        engine prefills it and decides while nothing is published) and goes out on the next
        frame whose state line is token for token the same ("frame" trigger): that is the
        decision on that frame, exactly (same context, greedy decoding), so only that frame's
        perception and the hit lie between its capture and the command. A frame that changes the
        line while the decision ahead is not yet made replaces it (decided ahead again); once it
        is made, a changed line, or a failed decision ahead (then the rate trigger), decides
        afresh (a miss), so a scene that keeps changing still gets its call.
        Returns False (decide now) when deciding ahead is off; True without deciding while no
        camera frame came yet (the first one decides ahead; none within stale_after_s: the
        no_sensor_data fallback)."""
        if not (self.p.decide_ahead and self.p.restate_before_decisions):
            return False
        if "camera" not in self._texts:
            return True
        self._state_queued = self._ahead_line = self._state_text()
        self.worker.decide_ahead(("state", self._ahead_line, 0.0), self._tool_choice())
        return True

    def _decide(self, stamp: Time, tools: list[str] | None = None) -> None:
        """Open a decision on the observation stamped `stamp` and hand it to the (free) engine."""
        self._first_call, self._ahead_line = False, None
        d = self.loop.open(stamp)
        received, perceived = self._latest_times if stamp == self._latest_stamp else (0.0, 0.0)
        self._traced[d.decision_id] = {"capture": stamp.nanoseconds * 1e-9, "received": received,
                                       "perceived": perceived}
        while len(self._traced) > TRACES_PENDING:       # decisions the engine never answered (fallbacks at once)
            del self._traced[next(iter(self._traced))]
        # the state line is prefilled just before the decision (queued readings wait behind it; it is
        # not prefilled again while it is the context's last message); its echo carries the decision's stamp
        self._state_queued = self._state_text()
        restate = ("state", self._state_queued, stamp.nanoseconds * 1e-9) if self.p.restate_before_decisions else None
        self.loop.dispatch(d, self._tool_choice(tools), restate)
        self._release_held()

    def _end_task(self, outcome: str, evidence: str) -> None:
        self.get_logger().info(f"task {outcome}: {evidence}")
        self.task.finish(outcome, evidence)

    def _check_result(self, result: ModelResult) -> ModelResult:
        """A decision in flight when the current task started never reaches the robot: it answered
        no task or the last one (the monitor publishes the safe fallback, reason "superseded"; the
        engine stops it at its next forward, `EngineWorker.new_episode`).

        A completion call never reaches the robot: when the robot still reports the task
        achieved, the task is done once its outcome is out (the monitor publishes the safe
        fallback with reason "task_done": the arm holds; see _on_resolved); otherwise the call is
        refused ("task_not_done") and the model is told."""
        if result.decision_id == self._superseded:
            return ModelResult(result.decision_id, "superseded", reason="decided before the current task started",
                               ttft_s=result.ttft_s, total_s=result.total_s, trace=result.trace)
        if result.status != "ok" or result.tool_call is None or result.tool_call["name"] != TASK_DONE:
            return result
        evidence = self._done_evidence()
        if self.task is None or not self.task.running or evidence is None:
            self._submit("robot", f"robot: task not done yet (decision {result.decision_id})", self.get_clock().now())
            return ModelResult(result.decision_id, "task_not_done", reason="the robot does not report it achieved",
                               ttft_s=result.ttft_s, total_s=result.total_s, trace=result.trace)
        return ModelResult(result.decision_id, "task_done", ttft_s=result.ttft_s, total_s=result.total_s,
                           reason=f"decision {result.decision_id}: the model called {TASK_DONE}; {evidence}",
                           trace=result.trace)

    def _on_outcome(self, cmd: ActionCommand | None, status: DeadlineStatus) -> None:
        """Every decision outcome (DeadlineMonitor hook): remember the call for the gripper state,
        count it for the task and send it as the task's feedback, answer a waiting Decide."""
        if cmd is None:
            return      # a late result dropped after its fallback
        self.gripper.sent(cmd.decision_id, cmd.tool_name, cmd.arguments_json)
        if cmd.source == "model" and cmd.tool_name not in ("hold", "stop") and self.p.action_feedback_topic:
            self._sent = (cmd.decision_id, self.get_clock().now())
            self._decide_ahead(cmd)
        task = self.task
        if task is not None and task.running and status.reason != CANCELLED:
            task.decisions += 1
            handle = self._task_handles.get(id(task))
            if handle is not None:
                handle.publish_feedback(RunTask.Feedback(
                    decision_id=cmd.decision_id, tool_name=cmd.tool_name, arguments_json=cmd.arguments_json,
                    source=cmd.source, status=status.reason, latency_s=status.latency_s))
        self._decide_outcome = (status, cmd)        # read by a Decide request that waits for it

    # ------------------------------------------------------------------ RunTask action, Decide service
    def _on_task_goal(self, goal: RunTask.Goal) -> GoalResponse:
        """Accept a valid goal while active (as nav2 does: an inactive node rejects goals)."""
        text = goal.task.strip()
        unknown = [t for t in goal.tools if t not in self._tool_names]
        idle = not unknown and self.p.tool_choice in ("required", "auto") and not self._state_tools(list(goal.tools))
        if (not self.active or not text or len(text) > self.p.max_goal_chars or unknown or idle
                or not math.isfinite(goal.timeout_s) or goal.timeout_s < 0):
            self.get_logger().warning(
                f"RunTask goal rejected: {'active' if self.active else 'inactive'}, {len(text)} characters, "
                f"unknown tools {unknown}, timeout_s {goal.timeout_s}"
                + (f"; none of its tools {list(goal.tools)} may be called with the {self.gripper.text()}" if idle else ""))
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def _on_task_accepted(self, goal_handle) -> None:
        """Start the goal's task. The goal is answered when the task ends: only then does it go
        through execute (ACCEPTED -> EXECUTING -> SUCCEEDED / ABORTED, or CANCELING -> CANCELED),
        so no coroutine waits in the executor meanwhile (rclpy polls pending coroutines in a busy
        loop); feedback flows from the first decision on."""
        g = goal_handle.request
        task = Task(g.task.strip(), self.get_clock().now(), list(g.tools), g.timeout_s, g.max_decisions,
                    on_finish=lambda t: self._answer_goal(goal_handle, t))
        self._task_handles[id(task)] = goal_handle
        self._start_task(task)

    def _answer_goal(self, goal_handle, task: Task) -> None:
        """Send the goal through execute to its result; skipped once the context is shut down
        (Ctrl-C: nothing can be published, the client sees the server go away). A shutdown that
        lands between that check and the status publish (rcl: "feedback publisher is invalid")
        is logged, not raised: the node is going away, and so is the goal."""
        if not (self.context.ok() and self._task_server is not None):
            return
        try:
            goal_handle.execute(lambda gh: self._task_result(task, gh))
        except RuntimeError as e:  # rcl's RCLError
            if "invalid" not in str(e):
                raise
            self.get_logger().warning(f"RunTask goal not answered: the action server went away ({e})")

    def _task_result(self, task: Task, goal_handle) -> RunTask.Result:
        self._task_handles.pop(id(task), None)
        if task.outcome == DONE:
            goal_handle.succeed()
        elif goal_handle.is_cancel_requested:
            goal_handle.canceled()
        else:
            goal_handle.abort()
        return RunTask.Result(outcome=task.outcome, evidence=task.evidence, decisions=task.decisions,
                              duration_s=(self.get_clock().now() - task.started).nanoseconds * 1e-9)

    def _on_task_cancel(self, goal_handle) -> CancelResponse:
        """Cancel mid-task: the safe fallback goes out (the arm holds) and the agent stops acting."""
        task = self.task
        if task is not None and task.running and self._task_handles.get(id(task)) is goal_handle:
            self.loop.stop(self._latest_stamp or self.get_clock().now(), CANCELLED)
            self._end_task(CANCELLED, f"cancel requested after {task.decisions} decisions; the safe fallback "
                                      f"({self.monitor.fallback}) was published")
        return CancelResponse.ACCEPT

    def _on_decide(self, request: Decide.Request, response: Decide.Response) -> Decide.Response:
        """One decision on demand, through the deadline monitor. Answers once its outcome is out
        (at most the deadline budget): the executor waits on the engine thread meanwhile, resolving
        its output and the deadline itself (the heartbeat goes on from the monitor's thread)."""
        unknown = [t for t in request.tools if t not in self._tool_names]
        idle = not unknown and self.p.tool_choice in ("required", "auto") and not self._state_tools(list(request.tools))
        if not self.active or self.loop.busy or unknown or idle:
            response.reason = (f"unknown tools {unknown}" if unknown else
                               f"none of the tools {list(request.tools)} may be called with the {self.gripper.text()}"
                               if idle else "inactive" if not self.active
                               else "engine_busy")     # a bad request is refused as such, busy or not
            return response
        self._decide_outcome = None
        stamp = self._latest_stamp or self.get_clock().now()
        if self._missing_sensors():
            self.monitor.fail_now(stamp, "no_sensor_data")
        else:
            self._decide(stamp, list(request.tools))
        while self._decide_outcome is None:
            self.worker.wait_output(self.p.monitor_period_s)
            self.loop.on_engine_output()
            self.monitor.check()
            self.monitor.deliver()      # a fallback at the deadline answers without the engine
        (status, cmd), self._decide_outcome = self._decide_outcome, None
        response.success, response.reason, response.command = status.met, status.reason, cmd
        return response

    def _echo_observation(self, item: Observed) -> None:
        msg = Observation(source=item.source, text=item.text, tokens=item.tokens)
        msg.header.stamp = Time(nanoseconds=int(round(item.stamp_s * 1e9))).to_msg()
        self._obs_pub.publish(msg)

    def _on_resolved(self, result: ModelResult, cmd: ActionCommand | None) -> None:
        node_times = self._traced.pop(result.decision_id, None)
        if cmd is not None:
            self._publish_target(cmd)
        if node_times is not None:      # a result dropped as late is traced too (never published)
            record = trace_record(result.decision_id, (result.tool_call or {}).get("name", ""), result.status,
                                  node_times, result.trace,
                                  0.0 if cmd is None else Time.from_msg(cmd.header.stamp).nanoseconds * 1e-9)
            self.traces.add(record)
            self._trace_pub.publish(String(data=json.dumps(record)))
        if result.status == "task_done" and self.task is not None:
            self._end_task(DONE, result.reason)     # after the completion's feedback went out

    def _publish_target(self, cmd: ActionCommand) -> None:
        pose = target_pose(json.loads(cmd.arguments_json), self.p.base_frame, self.p.object_plane_z)
        if pose is not None:
            pose.header.stamp = cmd.header.stamp
            self._pose_pub.publish(pose)

    # ------------------------------------------------------------------ diagnostics
    def _publish_diagnostics(self) -> None:
        """/diagnostics: decisions, inputs and engine, named "<fully qualified node name>: ..."
        with that name as hardware_id, so that two agents are told apart."""
        now = self.get_clock().now()
        fqn = self.get_fully_qualified_name()
        bad = sum(self.health.counts.values())
        inputs = DiagnosticStatus(
            name=f"{fqn}: inputs", message=f"{bad} bad inputs",
            level=DiagnosticStatus.WARN if bad > self._diag_seen_bad else DiagnosticStatus.OK,
            values=[KeyValue(key=f"bad_{k}", value=str(v)) for k, v in sorted(self.health.counts.items())]
            + [KeyValue(key=f"age_{s}_s", value=f"{(now - t).nanoseconds * 1e-9:.3f}")
               for s, t in sorted(self._last_rx.items())]
            + [KeyValue(key="observations_coalesced", value=str(self.worker.coalesced))])
        self._diag_seen_bad = bad
        w = self.worker
        engine = DiagnosticStatus(
            name=f"{fqn}: engine", message=w.fault or w.state,
            level={"ready": DiagnosticStatus.OK, "loading": DiagnosticStatus.WARN}.get(w.state, DiagnosticStatus.ERROR),
            values=[KeyValue(key="state", value=w.state), KeyValue(key="weights", value=w.weights),
                    KeyValue(key="context_tokens", value=str(w.context_tokens)),
                    KeyValue(key="triggers_skipped_busy", value=str(self._skipped_busy)),
                    KeyValue(key="triggers_skipped_executing", value=str(self._skipped_executing))]
            + [KeyValue(key=f"decided_ahead_{k}", value=str(v)) for k, v in w.ahead_counts.items()]
            + [KeyValue(key=k, value=v) for k, v in self.traces.key_values()])
        msg = DiagnosticArray(status=[self.monitor.diagnostic_status(f"{fqn}: decisions"), inputs, engine])
        for status in msg.status:
            status.hardware_id = fqn
        msg.header.stamp = now.to_msg()
        self._diag_pub.publish(msg)


def main(args: list[str] | None = None) -> int:
    """Console entry point `tokenspeed_agent`. Returns 0 on a clean shutdown (Ctrl-C / SIGTERM),
    2 on bad parameters or a failed start-up configure (tool file, model)."""
    return run_engine_node("tokenspeed_agent", AgentNode, (AgentParamsError, ConfigureError), args,
                           AgentParams.help_text())


if __name__ == "__main__":
    sys.exit(main())
