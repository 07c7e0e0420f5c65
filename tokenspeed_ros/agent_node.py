"""`tokenspeed_agent`: the ROS 2 node that runs an LLM agent on a robot arm under a deadline monitor.

Inputs: joint states and camera images (+ CameraInfo and the camera pose) become compact text
observations (`inputs`, `perception`) streamed into a resident tokenspeed Session on the engine
thread (`engine_worker`); an optional goal topic adds the task. Decisions are triggered at a fixed
rate and on events (new goal, changed scene, the robot finishing or rejecting the last call), one
at a time; while the robot executes a model call, rate and scene triggers wait for its feedback.
Each decision's deadline is measured from the newest sensor stamp.

The node tracks what the gripper holds from the robot's ActionFeedback (`GripperState`) and
masks actions by precondition: each decision may only call the tools configured for the current
state (`tools_when_empty` / `tools_when_holding`, OpenAI allowed_tools). Right before each
decision it streams a state line into the context ("objects ...; gripper holding red_cube; task:
..."), so a small model reads the state and the task last. The `DeadlineMonitor` publishes
each valid, timely tool call as an `ActionCommand` (plus a `PoseStamped` target for calls with a
position) and the safe fallback otherwise. Bad input is counted and dropped; missing sensors or a
missing engine give fallbacks. Counts and latency percentiles go to /diagnostics.

Run: `tokenspeed_agent --ros-args --params-file launch/config/agent.yaml`.
"""
from __future__ import annotations

import json
import re
import sys
import time
from collections import OrderedDict

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import PoseStamped
from rcl_interfaces.msg import SetParametersResult
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rclpy.time import Time
from sensor_msgs.msg import CameraInfo, Image, JointState
from std_msgs.msg import String
from tokenspeed_msgs.msg import ActionCommand, ActionFeedback, Observation

from tokenspeed_ros.deadline_monitor import DeadlineMonitor, ModelResult
from tokenspeed_ros.engine_worker import EngineWorker, Observed, run_engine_node
from tokenspeed_ros.inputs import BadInput, InputHealth, check_stamp, image_to_rgb, joint_state_text
from tokenspeed_ros.params import AgentParams, AgentParamsError
from tokenspeed_ros.perception import CameraModel, locate_cubes, objects_text

SENSORS = ("joint_states", "camera")    # sources that must be fresh for the engine to decide
CALLS_KEPT = 256                        # published calls remembered to interpret the robot's feedback


class GripperState:
    """What the gripper holds, from the robot's feedback on the agent's own calls.

    Feedback names only the decision, so `sent()` records each published call (decision id ->
    tool and arguments) and `feedback()` applies the robot's reports: a pick "done" -> holding
    its object (unless the detail says the grasp failed); a place "done" -> empty; a pick
    rejected because the gripper is "already holding X" -> holding X; a place rejected for "not
    holding" -> empty (the robot's own word corrects a missed event). Feedback is exact in time
    and names the object, which finger positions cannot (a closed gripper does not say which
    cube it holds, and is ambiguous while the fingers move). Not thread-safe (executor thread).
    """

    def __init__(self):
        self.holding: str | None = None           # object name, or None when empty
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

    def feedback(self, decision_id: int, tool: str, state: str, detail: str) -> bool:
        """Apply one ActionFeedback (state "applied", "done", "preempted" or "rejected");
        returns True when what the gripper holds changed."""
        before = self.holding
        if state == "done" and tool == "pick" and "fail" not in detail:
            _, arguments = self._calls.get(decision_id, (tool, {}))
            self.holding = arguments.get("object") or self.holding
        elif state == "done" and tool == "place":
            self.holding = None
        elif state == "rejected" and tool == "pick":
            held = re.search(r"already holding (\w+)", detail)
            self.holding = held.group(1) if held else self.holding
        elif state == "rejected" and tool == "place" and "not holding" in detail:
            self.holding = None
        return self.holding != before

    def text(self) -> str:
        """"gripper empty" or "gripper holding <object>"."""
        return "gripper empty" if self.holding is None else f"gripper holding {self.holding}"


def load_tools(path) -> list[dict]:
    """Read an OpenAI tool list (JSON array of {"type": "function", "function": {...}}).

    Raises AgentParamsError naming the file when it is missing or malformed.
    """
    try:
        tools = json.loads(open(path).read())
    except (OSError, json.JSONDecodeError) as e:
        raise AgentParamsError(f"tools_file {path}: {e}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and "function" in t for t in tools):
        raise AgentParamsError(f"tools_file {path}: expected a JSON list of OpenAI function tools")
    return tools


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


class AgentNode(Node):
    """The agent node. Parameters: see `AgentParams`. Raises AgentParamsError on bad parameters
    or an unreadable tool file; everything after construction is handled without raising."""

    def __init__(self, **node_kwargs):
        super().__init__("tokenspeed_agent", **node_kwargs)
        self.p = p = AgentParams.declare(self)
        self.add_on_set_parameters_callback(lambda _: SetParametersResult(
            successful=False, reason="tokenspeed_agent reads its parameters at start-up; restart it to change them"))
        tools = load_tools(p.resolved_tools_file())
        self.health = InputHealth(self.get_logger())
        self._camera_info: CameraInfo | None = None
        self._camera_pose: PoseStamped | None = None
        self._camera: CameraModel | None = None     # built when both of the above are valid
        self._started = self.get_clock().now()
        self._last_rx: dict[str, Time] = {}         # source -> node time of the last valid message
        self._latest_stamp: Time | None = None      # newest valid sensor stamp
        self._texts: dict[str, str] = {}            # source -> newest text (sent to the engine, or held)
        self._held: dict[str, tuple[Time, str]] = {}  # source -> (stamp, kind) of a reading held back
        self._state_queued = ""                     # the last state line given to the engine
        self._outstanding: int | None = None        # decision id the engine is working on
        self._event_pending = False                 # an event trigger waits for the engine
        self._executing: tuple[int, Time] | None = None    # robot's current model call: (id, applied at)
        self._skipped_busy = 0
        self._skipped_executing = 0
        self._diag_seen_bad = 0
        self.gripper = GripperState()
        p.check_tool_names([t["function"]["name"] for t in tools])

        self.monitor = DeadlineMonitor(
            self, action_topic=p.action_topic, status_topic=p.deadline_status_topic,
            budget_s=p.deadline_budget_s, fallback=p.fallback, period_s=p.monitor_period_s,
            qos_depth=p.command_qos_depth, qos_deadline_s=p.command_qos_deadline_s,
            on_outcome=lambda cmd, _: cmd is not None and self.gripper.sent(
                cmd.decision_id, cmd.tool_name, cmd.arguments_json))
        self._obs_pub = self.create_publisher(Observation, p.observation_topic, 10)
        self._pose_pub = self.create_publisher(PoseStamped, p.target_pose_topic, 10)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)

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

        self._wake = self.create_guard_condition(self._on_engine_output)
        self.worker = EngineWorker(model=p.model, threads=p.threads, quantize=p.quantize,
                                   system=p.system_prompt, tools=tools,
                                   tool_choice=self._tool_choice(), kv_budget=p.kv_budget_tokens,
                                   notify=self._wake.trigger, logger=self.get_logger(),
                                   repeat_slack=p.restate_slack_tokens)
        if p.decision_period_s > 0:
            self.create_timer(p.decision_period_s, lambda: self._trigger("rate"))
        self.create_timer(p.diagnostics_period_s, self._publish_diagnostics)
        self.worker.start()
        self.get_logger().info(f"tokenspeed_agent up: budget {p.deadline_budget_s} s, fallback {p.fallback}, "
                               f"decision period {p.decision_period_s} s, model {p.model or 'embedded'}")

    def close(self) -> bool:
        """Stop the engine thread; False when it is still inside a load or forward (see
        EngineWorker.close)."""
        self.monitor.close()
        return self.worker.close()

    # ------------------------------------------------------------------ inputs
    def _stamp(self, stamp) -> Time:
        now = self.get_clock().now()
        check_stamp(stamp, now.nanoseconds * 1e-9, self.p.max_future_s, self.p.max_age_s)
        return Time.from_msg(stamp, clock_type=now.clock_type)

    def _received(self, source: str, stamp: Time) -> None:
        self._last_rx[source] = self.get_clock().now()
        if self._latest_stamp is None or stamp > self._latest_stamp:
            self._latest_stamp = stamp

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
        """Give a reading to the engine. With restate_before_decisions the camera's objects enter
        the context only as part of the state line (one line, the state last), and every other
        reading except joint states is followed by the state line."""
        if not (source == "camera" and self.p.restate_before_decisions):
            self.worker.observe(source, text, stamp.nanoseconds * 1e-9, kind)
        if source != "joint_states":
            self._queue_state(stamp)

    def _queue_state(self, stamp: Time) -> None:
        """Stream the state line in when it changed, so that between decisions it is prefilled
        ahead of the next decision, which then restates it for free."""
        text = self._state_text()
        if self.p.restate_before_decisions and text != self._state_queued:
            self._state_queued = text
            self.worker.observe("state", text, stamp.nanoseconds * 1e-9)

    def _release_held(self) -> None:
        """Queue the newest held-back readings (the engine prefills them after a pending decision)."""
        held, self._held = self._held, {}
        for source, (stamp, kind) in held.items():
            self._send(source, self._texts[source], stamp, kind)

    def _on_joint_state(self, msg: JointState) -> None:
        try:
            stamp = self._stamp(msg.header.stamp)
            text = joint_state_text(msg)
        except BadInput as e:
            self.health.report(e, self.p.joint_states_topic)
            return
        self._received("joint_states", stamp)
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
        self._received("camera", stamp)
        if self._submit("camera", objects_text(objects), stamp) and self.p.decide_on_scene_change:
            self._trigger("scene")

    def _on_goal(self, msg: String) -> None:
        text = msg.data.strip()
        if not text or len(text) > self.p.max_goal_chars:
            self.health.report(BadInput("goal_invalid", f"{len(text)} characters (1..{self.p.max_goal_chars})"),
                               self.p.goal_topic)
            return
        if self._submit("goal", f"goal: {text}", self.get_clock().now(), kind="text") and self.p.decide_on_goal:
            self._trigger("goal")

    def _on_feedback(self, msg: ActionFeedback) -> None:
        """Track which call the robot is executing (its end triggers a decision) and tell the
        model how its calls ended ("robot: pick done (decision 7)", "robot: place rejected (...)")."""
        moving = msg.tool_name not in ("hold", "stop")
        if self.gripper.feedback(msg.decision_id, msg.tool_name, msg.state, msg.detail):
            self.get_logger().info(f"{self.gripper.text()} (decision {msg.decision_id} {msg.tool_name} {msg.state})")
        if msg.state == "applied":
            self._executing = (msg.decision_id, self.get_clock().now()) if moving else None
            return
        if moving:
            detail = f" ({msg.detail})" if msg.detail and msg.detail != "ok" else ""
            self._submit("robot", f"robot: {msg.tool_name} {msg.state}{detail} (decision {msg.decision_id})",
                         self.get_clock().now())
        if self._executing is not None and msg.decision_id == self._executing[0]:
            self._executing = None
            self._trigger("feedback")

    def _robot_executing(self) -> bool:
        if self._executing is None or self.p.decide_while_executing:
            return False
        return (self.get_clock().now() - self._executing[1]).nanoseconds * 1e-9 < self.p.execution_timeout_s

    # ------------------------------------------------------------------ decisions
    def _tool_choice(self):
        """decide()'s tool_choice for the current gripper state: the tools_when_empty /
        tools_when_holding subset in OpenAI's allowed_tools form (mode = the tool_choice
        parameter), all tools when that list is empty, or the one tool tool_choice names."""
        if self.p.tool_choice not in ("required", "auto"):
            return {"name": self.p.tool_choice}
        names = self.p.tools_when_empty if self.gripper.holding is None else self.p.tools_when_holding
        if not names:
            return self.p.tool_choice
        return {"type": "allowed_tools", "allowed_tools": {
            "mode": self.p.tool_choice, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}

    def _state_text(self) -> str:
        """The state line restated before each decision: "<objects>; <gripper>; task: <goal>"."""
        parts = [self._texts.get("camera", "objects unknown"), self.gripper.text()]
        goal = self._texts.get("goal")
        if goal:
            parts.append("task: " + goal.removeprefix("goal: "))
        return "; ".join(parts)

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
        """Start a decision now if the engine is free. `why`: "rate", "scene", "goal",
        "feedback" or "event" (deferred while the engine was busy). Rate triggers also keep safe
        actions flowing while the engine is stuck past a deadline."""
        now = self.get_clock().now()
        stamp = self._latest_stamp or now
        if why in ("rate", "scene") and self._robot_executing():
            self._skipped_executing += 1
            return
        if self._outstanding is not None:
            if why == "rate" and not self.monitor.is_pending(self._outstanding):
                self.monitor.fail_now(stamp, "engine_busy")
            else:
                self._event_pending |= why != "rate"
                self._skipped_busy += 1
            return
        if self._missing_sensors():
            self.monitor.fail_now(stamp, "no_sensor_data")
            return
        if self.worker.state != "ready":
            self.monitor.fail_now(stamp, "engine_fault" if self.worker.state == "fault" else "engine_loading")
            return
        d = self.monitor.open(stamp)
        remaining_s = (d.deadline - now).nanoseconds * 1e-9 - self.p.publish_margin_s
        self._outstanding = d.decision_id
        # the state line is prefilled just before the decision (queued readings wait behind it; it is
        # not prefilled again while it is the context's last message); its echo carries the decision's stamp
        self._state_queued = self._state_text()
        restate = ("state", self._state_queued, stamp.nanoseconds * 1e-9) if self.p.restate_before_decisions else None
        self.worker.decide(d.decision_id, time.monotonic() + remaining_s, self._tool_choice(), restate)
        self._release_held()

    def _on_engine_output(self) -> None:
        for item in self.worker.drain():
            if isinstance(item, Observed):
                msg = Observation(source=item.source, text=item.text, tokens=item.tokens)
                msg.header.stamp = Time(nanoseconds=int(round(item.stamp_s * 1e9))).to_msg()
                self._obs_pub.publish(msg)
                continue
            assert isinstance(item, ModelResult)
            if item.decision_id == self._outstanding:
                self._outstanding = None
            cmd = self.monitor.resolve(item)
            if cmd is not None:
                self._publish_target(cmd)
        if self._outstanding is None and self._event_pending:
            self._event_pending = False
            self._trigger("event")

    def _publish_target(self, cmd: ActionCommand) -> None:
        pose = target_pose(json.loads(cmd.arguments_json), self.p.base_frame, self.p.object_plane_z)
        if pose is not None:
            pose.header.stamp = cmd.header.stamp
            self._pose_pub.publish(pose)

    # ------------------------------------------------------------------ diagnostics
    def _publish_diagnostics(self) -> None:
        now = self.get_clock().now()
        bad = sum(self.health.counts.values())
        inputs = DiagnosticStatus(
            name="tokenspeed_agent: inputs", message=f"{bad} bad inputs",
            level=DiagnosticStatus.WARN if bad > self._diag_seen_bad else DiagnosticStatus.OK,
            values=[KeyValue(key=f"bad_{k}", value=str(v)) for k, v in sorted(self.health.counts.items())]
            + [KeyValue(key=f"age_{s}_s", value=f"{(now - t).nanoseconds * 1e-9:.3f}")
               for s, t in sorted(self._last_rx.items())]
            + [KeyValue(key="observations_coalesced", value=str(self.worker.coalesced))])
        self._diag_seen_bad = bad
        w = self.worker
        engine = DiagnosticStatus(
            name="tokenspeed_agent: engine", message=w.fault or w.state,
            level={"ready": DiagnosticStatus.OK, "loading": DiagnosticStatus.WARN}.get(w.state, DiagnosticStatus.ERROR),
            values=[KeyValue(key="state", value=w.state), KeyValue(key="weights", value=w.weights),
                    KeyValue(key="context_tokens", value=str(w.context_tokens)),
                    KeyValue(key="triggers_skipped_busy", value=str(self._skipped_busy)),
                    KeyValue(key="triggers_skipped_executing", value=str(self._skipped_executing))])
        msg = DiagnosticArray(status=[self.monitor.diagnostic_status("tokenspeed_agent: decisions"), inputs, engine])
        msg.header.stamp = now.to_msg()
        self._diag_pub.publish(msg)


def main(args: list[str] | None = None) -> int:
    """Console entry point `tokenspeed_agent`. Returns 0 on a clean shutdown (Ctrl-C / SIGTERM),
    2 on bad parameters."""
    return run_engine_node("tokenspeed_agent", AgentNode, (AgentParamsError,), args)


if __name__ == "__main__":
    sys.exit(main())
