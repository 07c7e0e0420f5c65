"""`tokenspeed_agent`: the ROS 2 node that runs an LLM agent on a robot arm under a deadline monitor.

A managed (lifecycle) node with an engine (`managed_node.EngineNode`). Joint states and camera
images become compact text observations (`inputs`, `perception`); the ROS-free
`context_policy.ContextPolicy` decides what enters the resident session, the tools each decision
may call and which calls are decided ahead; this node gates the inputs, triggers decisions (at a
rate and on events, one at a time, only while a task runs unless decide_without_task; a decision's
deadline runs from the stamp of the newest reading in the context, or the feedback it answers) and
wires ROS to it. Tasks arrive as `RunTask` goals (`task_action`) or on the goal topic; `Decide`
makes one decision on demand. The `DeadlineMonitor` publishes each valid, timely tool call and the
safe fallback otherwise; traces go to `<action_topic>/trace`, counts to /diagnostics.

Run: `tokenspeed_agent --ros-args --params-file tokenspeed_ros/config/agent.yaml`.
"""
from __future__ import annotations

import json
import sys
import time

from diagnostic_msgs.msg import DiagnosticStatus, KeyValue
from geometry_msgs.msg import PoseStamped
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rclpy.time import Time
from sensor_msgs.msg import CameraInfo, Image, JointState
from std_msgs.msg import String
from tokenspeed_msgs.msg import ActionCommand, ActionFeedback, DeadlineStatus, Observation
from tokenspeed_msgs.srv import Decide

from tokenspeed_ros.context_policy import SENSORS, ContextPolicy
from tokenspeed_ros.deadline_monitor import DeadlineMonitor, ModelResult
from tokenspeed_ros.decision_trace import TraceStats, trace_record
from tokenspeed_ros.engine_worker import DecidedAhead, Observed, run_engine_node
from tokenspeed_ros.inputs import BadInput, InputHealth, SensorGate, check_stamp, image_to_rgb, joint_state_text
from tokenspeed_ros.managed_node import ConfigureError, EngineNode
from tokenspeed_ros.params import AgentParams, AgentParamsError
from tokenspeed_ros.perception import CameraRig, objects_text
from tokenspeed_ros.task import CANCELLED, DONE, FAILED, TASK_DONE, TASK_DONE_TOOL, Task, parse_status
from tokenspeed_ros.task_action import TaskActionServer

TRACES_PENDING = 64                     # decisions whose reading times are kept until the engine answers


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


class AgentNode(EngineNode):
    """The agent node, a managed (lifecycle) node: see `ManagedNode` for the transitions and
    `AgentParams` for the parameters. Raises AgentParamsError at construction on bad parameters;
    a bad tool file or model fails configure; everything after that is handled without raising.
    The context policy and the robot's execution are `ctx` (`ContextPolicy`, no ROS); this class
    gates the inputs, triggers decisions and wires the task action, `Decide` and /diagnostics."""

    PARAMS = AgentParams

    def __init__(self, **node_kwargs):
        self.ctx: ContextPolicy | None = None        # from configure to cleanup
        self._tasks: TaskActionServer | None = None
        super().__init__("tokenspeed_agent", **node_kwargs)

    @property
    def task(self) -> Task | None:
        """The current or last task."""
        return self.ctx.task if self.ctx is not None else None

    def _now_s(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def configure(self) -> None:
        """Topics, deadline monitor, timers; compiles the tools and loads the model (waits for
        it). Raises AgentParamsError (also for the tool file) or ConfigureError (the model did not load)."""
        p = self.p
        tools = p.load_tools()
        if TASK_DONE not in [t["function"]["name"] for t in tools]:
            tools.append(TASK_DONE_TOOL)
        tool_names = [t["function"]["name"] for t in tools]
        p.check_tool_names(tool_names)
        self.health = InputHealth(self.get_logger())
        self.inputs = SensorGate(self.health, SENSORS, self._now_s())
        self.camera = CameraRig()
        self._traced: dict[int, dict] = {}          # decision id -> node times of its reading, until resolved
        self.traces = TraceStats()
        self._superseded: int | None = None         # the decision in flight when the current task started
        self._skipped_busy = self._skipped_executing = self._diag_seen_bad = 0
        self._decide_outcome: tuple | None = None   # (DeadlineStatus, ActionCommand) of the latest outcome

        self.monitor = DeadlineMonitor(
            self, action_topic=p.action_topic, status_topic=p.deadline_status_topic,
            budget_s=p.deadline_budget_s, fallback=p.fallback, period_s=p.monitor_period_s,
            qos_depth=p.command_qos_depth, qos_deadline_s=p.command_qos_deadline_s, on_outcome=self._on_outcome,
            active=lambda: self.active, frame_id=p.base_frame, thread_priority=p.monitor_thread_priority)
        self._obs_pub = self.create_publisher(Observation, p.observation_topic, 10)
        self._pose_pub = self.create_publisher(PoseStamped, p.target_pose_topic, 10)
        self._trace_pub = self.create_publisher(String, p.action_topic + "/trace", 10)

        sensor_qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT
                                if p.sensor_reliability == "best_effort" else ReliabilityPolicy.RELIABLE)
        self.create_subscription(JointState, p.joint_states_topic, self._on_joint_state, sensor_qos)
        # the camera model before the images: the executor takes ready subscriptions in the order they
        # were made, so the frame that waited while the model loaded is located as soon as configure
        # ends, with the intrinsics and pose that waited beside it, instead of failing "no_camera_model"
        # and leaving the task's first call to wait for the next frame
        self.create_subscription(CameraInfo, p.camera_info_topic,
                                 lambda m: self._camera_msg(self.camera.on_info, m, p.camera_info_topic), sensor_qos)
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.create_subscription(PoseStamped, p.camera_pose_topic,
                                 lambda m: self._camera_msg(self.camera.on_pose, m, p.camera_pose_topic), latched)
        self.create_subscription(Image, p.image_topic, self._on_image, sensor_qos)
        if p.goal_topic:
            self.create_subscription(String, p.goal_topic, self._on_goal, latched)
        if p.action_feedback_topic:
            self.create_subscription(ActionFeedback, p.action_feedback_topic, self._on_feedback, 50)
        if p.task_status_topic:
            self.create_subscription(String, p.task_status_topic, self._on_task_status, latched)

        self._rate_timer = self.replace_timer(None, p.decision_period_s, lambda: self._trigger("rate"))
        self._diag_timer = self.create_timer(p.diagnostics_period_s, self._publish_diagnostics)
        self.start_engine(tools, on_observed=self._echo_observation, on_decided_ahead=self._on_decided_ahead,
                          check_result=self._check_result, on_resolved=self._on_resolved,
                          repeat_slack=p.restate_slack_tokens, replace_sources=("state",))
        self.ctx = ContextPolicy(self.worker, tool_names)
        # the action server and the service appear once the model is loaded
        if p.run_task_action:
            self._tasks = TaskActionServer(self, p.run_task_action, max_chars=lambda: self.p.max_goal_chars,
                                           refusal=self._refusal, start=self._start_task, cancel=self._cancel_task,
                                           current=lambda: self.task)
        if p.decide_service:
            self.create_service(Decide, p.decide_service, self._on_decide)
        self.get_logger().info(f"tokenspeed_agent configured: budget {p.deadline_budget_s} s, fallback {p.fallback}, "
                               f"decision period {p.decision_period_s} s, model {p.model or 'embedded'}")
        self._publish_diagnostics()   # the engine's "ready" now, not up to diagnostics_period_s later

    def activate(self) -> None:
        """Say on /diagnostics at once that the node is active (its engine status's "active"), so
        that a task sender (the demo's harness) sends its goal now, not at the next period."""
        self._publish_diagnostics()

    def deactivate(self) -> None:
        """The safe fallback goes out (for the decision in progress, or on its own) and nothing
        decides until activate."""
        self.loop.stop(self.inputs.latest_stamp or self.get_clock().now(), "deactivated")

    def cleanup(self, timeout_s: float = 1.0) -> bool:
        """End the task, remove the action server, then stop the monitor and engine threads (EngineNode)."""
        if self.task is not None:
            self.task.finish(CANCELLED, "the node was cleaned up")
        if self._tasks is not None:
            self._tasks.destroy()
            self._tasks = None
        return super().cleanup(timeout_s)

    def apply_live(self, new: AgentParams, changed: set[str]) -> None:
        """Apply live parameters (AgentParams.LIVE) to the running node."""
        if {"tools_when_empty", "tools_when_holding", "tool_choice"} & changed:
            new.check_tool_names(self.ctx.tool_names)
        super().apply_live(new, changed)
        self.monitor.fallback = new.fallback
        self.monitor.frame_id = new.base_frame
        self.worker.set_repeat_slack(new.restate_slack_tokens)
        if "decision_period_s" in changed:
            self._rate_timer = self.replace_timer(self._rate_timer, new.decision_period_s, lambda: self._trigger("rate"))
        if "diagnostics_period_s" in changed:
            self._diag_timer = self.replace_timer(self._diag_timer, new.diagnostics_period_s, self._publish_diagnostics)

    # ------------------------------------------------------------------ inputs
    def _stamp(self, stamp) -> Time:
        now = self.get_clock().now()
        check_stamp(stamp, now.nanoseconds * 1e-9, self.p.max_future_s, self.p.max_age_s)
        return Time.from_msg(stamp, clock_type=now.clock_type)

    def _submit(self, source: str, text: str, stamp: Time, kind: str = "sensor") -> bool:
        """`ContextPolicy.submit` at the node's time; returns False when the text is unchanged."""
        return self.ctx.submit(self.p, source, text, stamp.nanoseconds * 1e-9, self._now_s(), kind)

    def _on_joint_state(self, msg: JointState) -> None:
        received = time.time()
        try:
            stamp = self._stamp(msg.header.stamp)
            text = joint_state_text(msg)
        except BadInput as e:
            self.health.report(e, self.p.joint_states_topic)
            return
        self.inputs.received("joint_states", stamp, self._now_s(), received, feeds=self.p.joint_states_in_context)
        if self.p.joint_states_in_context:
            self._submit("joint_states", text, stamp)

    def _camera_msg(self, take, msg, topic: str) -> None:
        """A CameraInfo or camera pose message for `CameraRig` (`take`: its on_info or on_pose)."""
        try:
            take(msg)
        except BadInput as e:
            self.health.report(e, topic)

    def _on_image(self, msg: Image) -> None:
        received = time.time()
        try:
            stamp = self._stamp(msg.header.stamp)
            objects = self.camera.locate(image_to_rgb(msg), self.p.object_plane_z, self.p.min_blob_area_px,
                                         f"no valid {self.p.camera_info_topic} and {self.p.camera_pose_topic} yet")
        except BadInput as e:
            self.health.report(e, self.p.image_topic)
            return
        self.inputs.received("camera", stamp, self._now_s(), received)
        if self._submit("camera", objects_text(objects), stamp) and self.p.decide_on_scene_change:
            self._trigger("scene")
        elif self.ctx.first_ahead_hit(self.p):
            self._trigger("frame")

    def _on_goal(self, msg: String) -> None:
        """The goal topic (off unless goal_topic is set): a new text starts a task (no feedback or result); the
        same text again (a latched re-delivery) changes nothing; a running RunTask goal is never preempted."""
        if self.task is not None and self.task.running and self._tasks is not None and self._tasks.owns(self.task):
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
        context (`ContextPolicy.start_task`) and decide on it."""
        if self.task is not None:
            self.task.finish(CANCELLED, "replaced by a new task")
        self.get_logger().info(f"task: {task.text}")
        self._superseded = self.loop.outstanding
        if self.ctx.start_task(self.p, task, self._now_s()) and self.p.decide_on_goal:
            self._trigger("goal")

    def _on_task_status(self, msg: String) -> None:
        status = parse_status(msg.data)
        if status is None:
            self.health.report(BadInput("status_invalid", "not a JSON object"), self.p.task_status_topic)
            return
        evidence = self.ctx.on_status(self.p, status, self._now_s())
        if evidence:
            self.get_logger().info(f"the robot reports the task achieved: {evidence}")

    def _on_feedback(self, msg: ActionFeedback) -> None:
        """The robot's feedback on a call (`ContextPolicy.on_feedback`); the end of the call it
        executes triggers a decision."""
        holding = self.ctx.gripper.holding
        ended = self.ctx.on_feedback(self.p, msg.decision_id, msg.tool_name, msg.state, msg.detail, self._now_s())
        if self.ctx.gripper.holding != holding:
            self.get_logger().info(f"{self.ctx.gripper.text()} (decision {msg.decision_id} {msg.tool_name} {msg.state})")
        if ended:       # the decision answers this feedback: stamped with it when valid (and the newest)
            try:
                self._trigger("feedback", self._stamp(msg.header.stamp))
            except BadInput:
                self._trigger("feedback")

    def _on_decided_ahead(self, item: DecidedAhead) -> None:
        """The task's first call decided ahead goes out once ready on an unchanged frame (`first_ahead_hit`)."""
        if item.text == self.ctx.ahead_line and self.ctx.first_ahead_hit(self.p):
            self._trigger("frame")

    # ------------------------------------------------------------------ decisions
    def _trigger(self, why: str, stamp: Time | None = None) -> None:
        """Start a decision now if the engine is free, on the observation stamped `stamp` (None:
        the newest reading in the context). `why`: "rate", "scene", "goal", "frame" (the task's first
        call decided ahead is ready on the newest frame's state line: `ContextPolicy.decide_first_ahead`) or
        "feedback"; one that finds the engine busy runs when it is free, as what it was. Only
        a goal decides while the robot executes a model call. Rate triggers also keep safe
        actions flowing while the engine is stuck past a deadline. Nothing decides while the
        node is not active, nor before its first task (unless decide_without_task), nor after a task ended."""
        if not self.active or (self.task is None and not self.p.decide_without_task):
            return
        now, given = self.get_clock().now(), stamp
        stamp = self.inputs.newest(stamp) or now
        if self.task is not None:
            over = self.task.over_budget(now) if self.task.running else None
            if over is not None:
                self._end_task(FAILED, over)
            if not self.task.running:       # done, failed or cancelled: the agent stops acting
                return
        if why != "goal" and self.ctx.robot_executing(self.p, now.nanoseconds * 1e-9):     # a new task may preempt the robot; nothing else
            self._skipped_executing += 1
            return
        if self.loop.busy:
            if why == "rate" and not self.monitor.is_pending(self.loop.outstanding):
                self.monitor.fail_now(stamp, "engine_busy")
            else:
                if why != "rate":
                    self.loop.defer(lambda: self._trigger(why, given))
                self._skipped_busy += 1
            return
        if self.inputs.missing(self._now_s(), self.p.stale_after_s):
            self.monitor.fail_now(stamp, "no_sensor_data")
            return
        first = self.ctx.first_call_trigger(self.p, why)
        if first == "wait":
            return
        if first == "afresh":
            self.get_logger().info(f"task's first call decided afresh on a {why} trigger (decided ahead: "
                                   f"{'none' if self.worker.decided_ahead is None else 'another state line'})")
        self._decide(stamp)

    def _decide(self, stamp: Time, tools: list[str] | None = None) -> None:
        """Open a decision on the observation stamped `stamp` and hand it to the (free) engine."""
        d = self.loop.open(stamp)
        received, perceived = self.inputs.latest_times if stamp == self.inputs.latest_stamp else (0.0, 0.0)
        self._traced[d.decision_id] = {"capture": stamp.nanoseconds * 1e-9, "received": received,
                                       "perceived": perceived}
        while len(self._traced) > TRACES_PENDING:       # decisions the engine never answered (fallbacks at once)
            del self._traced[next(iter(self._traced))]
        # the state line's echo carries the decision's stamp
        restate = self.ctx.before_decision(self.p, stamp.nanoseconds * 1e-9)
        self.loop.dispatch(d, self.ctx.tool_choice(self.p, tools), restate)
        self.ctx.release_held(self.p)

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
        evidence = self.ctx.done_evidence(self.p)
        if self.task is None or not self.task.running or evidence is None:
            self._submit("robot", f"robot: task not done yet (decision {result.decision_id})", self.get_clock().now())
            return ModelResult(result.decision_id, "task_not_done", reason="the robot does not report it achieved",
                               ttft_s=result.ttft_s, total_s=result.total_s, trace=result.trace)
        return ModelResult(result.decision_id, "task_done", ttft_s=result.ttft_s, total_s=result.total_s,
                           reason=f"decision {result.decision_id}: the model called {TASK_DONE}; {evidence}",
                           trace=result.trace)

    def _on_outcome(self, cmd: ActionCommand | None, status: DeadlineStatus) -> None:
        """Every decision outcome (DeadlineMonitor hook): the context policy learns of the call
        (`ContextPolicy.on_published`), the task counts it and sends it as its feedback, a waiting
        Decide is answered."""
        if cmd is None:
            return      # a late result dropped after its fallback
        self.ctx.on_published(self.p, cmd.decision_id, cmd.tool_name, cmd.arguments_json, cmd.source, self._now_s())
        task = self.task
        if task is not None and task.running and status.reason != CANCELLED:
            task.decisions += 1
            if self._tasks is not None:
                self._tasks.feedback(task, dict(
                    decision_id=cmd.decision_id, tool_name=cmd.tool_name, arguments_json=cmd.arguments_json,
                    source=cmd.source, status=status.reason, latency_s=status.latency_s))
        self._decide_outcome = (status, cmd)        # read by a Decide request that waits for it

    # ------------------------------------------------------------------ RunTask action, Decide service
    def _refusal(self, tools: list[str]) -> str | None:
        """Why a goal or request to decide with `tools` is refused now (a bad request as such,
        else "inactive"), or None."""
        return self.ctx.refusal(self.p, tools) or (None if self.active else "inactive")

    def _cancel_task(self, task: Task) -> None:
        """Cancel mid-task: the safe fallback goes out (the arm holds) and the agent stops acting."""
        self.loop.stop(self.inputs.latest_stamp or self.get_clock().now(), CANCELLED)
        self._end_task(CANCELLED, f"cancel requested after {task.decisions} decisions; the safe fallback "
                                  f"({self.monitor.fallback}) was published")

    def _on_decide(self, request: Decide.Request, response: Decide.Response) -> Decide.Response:
        """One decision on demand, through the deadline monitor. Answers once its outcome is out
        (at most the deadline budget): the executor waits on the engine thread meanwhile, resolving
        its output and the deadline itself (the heartbeat goes on from the monitor's thread)."""
        refusal = self._refusal(list(request.tools))
        if refusal or self.loop.busy:
            response.reason = refusal or "engine_busy"
            return response
        self._decide_outcome = None
        stamp = self.inputs.latest_stamp or self.get_clock().now()
        if self.inputs.missing(self._now_s(), self.p.stale_after_s):
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
        """/diagnostics: decisions, inputs and engine (its state, and "active": "true" while the
        node is active, i.e. accepts tasks), named "<fully qualified node name>: ..." with that name
        as hardware_id, so that two agents are told apart."""
        now = self.get_clock().now()
        fqn = self.get_fully_qualified_name()
        bad = sum(self.health.counts.values())
        inputs = DiagnosticStatus(
            name=f"{fqn}: inputs", message=f"{bad} bad inputs",
            level=DiagnosticStatus.WARN if bad > self._diag_seen_bad else DiagnosticStatus.OK,
            values=[KeyValue(key=f"bad_{k}", value=str(v)) for k, v in sorted(self.health.counts.items())]
            + [KeyValue(key=f"age_{s}_s", value=f"{now.nanoseconds * 1e-9 - t:.3f}")
               for s, t in sorted(self.inputs.last_rx.items())]
            + [KeyValue(key="observations_coalesced", value=str(self.worker.coalesced))])
        self._diag_seen_bad = bad
        w = self.worker
        engine = DiagnosticStatus(
            name=f"{fqn}: engine", message=w.fault or w.state,
            level={"ready": DiagnosticStatus.OK, "loading": DiagnosticStatus.WARN}.get(w.state, DiagnosticStatus.ERROR),
            values=[KeyValue(key="state", value=w.state), KeyValue(key="active", value=str(self.active).lower()),
                    KeyValue(key="weights", value=w.weights),
                    KeyValue(key="context_tokens", value=str(w.context_tokens)),
                    KeyValue(key="triggers_skipped_busy", value=str(self._skipped_busy)),
                    KeyValue(key="triggers_skipped_executing", value=str(self._skipped_executing))]
            + [KeyValue(key=f"decided_ahead_{k}", value=str(v)) for k, v in w.ahead_counts.items()]
            + [KeyValue(key=k, value=v) for k, v in self.traces.key_values()] + self.startup_values())
        self.publish_diagnostics(inputs, engine)


def main(args: list[str] | None = None) -> int:
    """Console entry point `tokenspeed_agent`. Returns 0 on a clean shutdown (Ctrl-C / SIGTERM),
    2 on bad parameters or a failed start-up configure (tool file, model)."""
    return run_engine_node("tokenspeed_agent", AgentNode, (AgentParamsError, ConfigureError), args,
                           AgentParams.help_text())


if __name__ == "__main__":
    sys.exit(main())
