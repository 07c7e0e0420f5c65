"""Deadline monitor: the only path by which the agent's commands reach the robot.

In the spirit of ros2_control's command timeouts: every decision is opened with a deadline
(observation stamp + budget). A valid model call that arrives before the deadline is published as
an `ActionCommand` (source "model"). Otherwise - the deadline passes (checked by a ROS timer), the
engine returns no valid call, or the engine faults - the configured safe fallback is published
(source "fallback": "hold", "stop" or "last_valid" = the last valid model call again, "hold" if
there was none). A model result that arrives after its fallback went out is dropped, never
executed, and reported with reason "late_result_dropped". Each outcome is a `DeadlineStatus`.

Nothing the host node does can delay a fallback: the deadline timer and the command and status
publishers live on a monitor-owned node spun by its own executor thread, so a slow callback of
the host (a huge image in perception, a sensor flood) does not hold them. A fallback for a
missed deadline goes out at most `FALLBACK_BOUND_S` after the deadline (one timer period plus
scheduling; for a decision the host opened on a reading already older than the budget, counted
as "opened_after_deadline", after it was opened); each one's lateness is measured and one
beyond the bound is counted ("fallback_late"). The monitor's thread also publishes the heartbeat
(std_msgs/Header, frame_id = the host's fully qualified name, every `HEARTBEAT_PERIOD_S`) on the
host's resolved command topic + `/heartbeat` (a remapped command topic carries its own
heartbeat), only while the host is active: a robot-side command timeout (ros2_control's
`cmd_timeout`, the simulator's `cmd_timeout_s`) stops the arm when the agent is killed, hangs
or is deactivated; a host callback that waits (a `Decide` call) does not silence it, since the
monitor that publishes every fallback is the one still beating.

A jump of the host's clock (`use_sim_time` with a /clock that jumps, CLOCK_JUMP_S or more
forward or any step back) moves every open deadline with it, so each decision keeps the budget
it had left: a backward jump cannot hold a fallback back by the size of the jump, and a forward
one is not counted as lateness; jumps are counted ("clock_jump").

Under CPU load the monitor's thread can wait on the run queue for tens of milliseconds after its
timer is due; `thread_priority` gives it the SCHED_FIFO real-time policy, as ros2_control's
controller manager does for its control loop, so it runs as soon as it wakes. Without the privilege
for it (CAP_SYS_NICE or an rtprio limit) the monitor warns once and runs in the default policy;
`scheduling` and /diagnostics say which.

The command publisher also offers a QoS deadline (`qos_deadline_s`); the DDS layer reports
periods without any command, which are counted (`qos_deadline_missed`). Everything is counted
and exposed by `diagnostic_status()` for /diagnostics.
"""
from __future__ import annotations

import json
import os
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue
from rclpy.duration import Duration
from rclpy.event_handler import PublisherEventCallbacks
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import QoSProfile, ReliabilityPolicy
from rclpy.clock import JumpThreshold, TimeJump
from rclpy.time import Time
from std_msgs.msg import Header
from tokenspeed_msgs.msg import ActionCommand, DeadlineStatus

from tokenspeed_ros.spin import SPIN_TIMEOUT_S, spin_once

FALLBACKS = ("hold", "stop", "last_valid")
LATENCY_WINDOW = 1000          # decisions kept for the latency percentiles
EXPIRED_KEPT = 256             # expired decisions remembered to flag their late results
FALLBACK_BOUND_S = 0.02        # a missed deadline's fallback is published at most this late (s)
CLOCK_JUMP_S = 1.0             # a forward step of the host's clock this large is a jump, not time passing (s)
HEARTBEAT_PERIOD_S = 0.1       # the host's heartbeat period on {action_topic}/heartbeat (s)
HEARTBEAT_SUFFIX = "/heartbeat"


@dataclass
class Decision:
    """One open decision: id, the stamp of the observation it answers, its absolute deadline and
    when it was opened (None when unknown)."""

    decision_id: int
    observation_stamp: Time
    deadline: Time
    opened: Time | None = None


@dataclass
class ModelResult:
    """What the engine returned for a decision.

    status: "ok", "deadline_missed", "invalid", "text" (as tokenspeed Decision.status) or
    "engine_fault" (decide() raised or no engine). tool_call: {"name", "arguments"} when "ok".
    ttft_s / total_s: engine time to first token and decide() duration, seconds.
    trace: the engine thread's stages of this decision (`engine_worker.DecisionTrace.as_dict`), or None.
    """

    decision_id: int
    status: str
    tool_call: dict | None = None
    reason: str = ""
    ttft_s: float = 0.0
    total_s: float = 0.0
    trace: dict | None = None


class DeadlineMonitor:
    """Publishes model calls that meet their deadline, and the safe fallback for every other decision.

    node: the host rclpy Node (its clock, its heartbeat timer and the guard condition that runs
    on_outcome); budget_s: observation stamp -> action deadline (seconds); fallback: one of
    FALLBACKS; period_s: deadline timer period (seconds; keep it under FALLBACK_BOUND_S);
    qos_deadline_s: QoS deadline offered on the command topic (0 disables); on_outcome: called
    after every DeadlineStatus is published, as on_outcome(command, status) with the
    ActionCommand published for that decision, or None for a late result dropped after its
    fallback went out - always on the host's executor thread (an outcome of the deadline timer
    is handed over through a guard condition, or `deliver()` from a host callback that waits),
    in order; active: the heartbeat goes out while it returns True (called on the monitor's
    thread; a plain flag read); frame_id: header.frame_id of every command (the frame its
    arguments are in, e.g. the robot base frame; `frame_id` may be changed later); thread_priority:
    SCHED_FIFO priority (1-99) of the monitor's thread, 0 = the default policy (a refusal by the
    OS is logged as a warning, not raised; `scheduling` says what the thread got). The public
    methods are thread-safe;
    call `close()` before destroying the host node. Raises ValueError for an unknown fallback.
    """

    def __init__(self, node, *, action_topic: str, status_topic: str, budget_s: float, fallback: str,
                 period_s: float, qos_depth: int = 10, qos_deadline_s: float = 0.0,
                 on_outcome: Callable[[ActionCommand | None, DeadlineStatus], None] | None = None,
                 active: Callable[[], bool] = lambda: True, frame_id: str = "", thread_priority: int = 0):
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback {fallback!r} is not one of {FALLBACKS}")
        self._node = node
        self._clock = node.get_clock()
        self.budget = Duration(seconds=budget_s)
        self.fallback = fallback
        self.frame_id = frame_id
        self._on_outcome = on_outcome
        self._lock = threading.RLock()
        self._outcomes: deque = deque()         # (command, status) waiting for the host thread
        self._next_id = 1
        self._pending: dict[int, Decision] = {}
        self._expired: OrderedDict[int, Decision] = OrderedDict()
        self._last_valid: tuple[str, str] | None = None     # (tool name, arguments JSON)
        self.counts: Counter[str] = Counter()               # outcomes and reasons, see diagnostic_status
        self.latency_s: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.ttft_s: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.fallback_lateness_s: deque[float] = deque(maxlen=LATENCY_WINDOW)  # deadline -> fallback, s
        self._reported: Counter[str] = Counter()

        # The monitor's own node and executor thread: the timer and publishers nothing else holds.
        # Without the process's global ROS arguments: a `-r __node:=name` meant for the host would
        # rename this node too (two nodes of one name). Topic names are resolved by the host, so its
        # namespace and remappings still apply.
        self._own = rclpy.create_node(f"{node.get_name()}_deadline_monitor", namespace=node.get_namespace(),
                                      context=node.context, use_global_arguments=False)
        qos = QoSProfile(depth=qos_depth, reliability=ReliabilityPolicy.RELIABLE)
        if qos_deadline_s > 0:
            qos.deadline = Duration(seconds=qos_deadline_s)
        self._action_pub = self._own.create_publisher(
            ActionCommand, node.resolve_topic_name(action_topic), qos,
            event_callbacks=PublisherEventCallbacks(deadline=self._on_qos_deadline,
                                                    incompatible_qos=self._on_incompatible_qos))
        self._status_pub = self._own.create_publisher(DeadlineStatus, node.resolve_topic_name(status_topic), 10)
        self._own.create_timer(period_s, self.check)
        self._active = active
        self._beat_frame = node.get_fully_qualified_name()
        self.heartbeat_topic = node.resolve_topic_name(action_topic) + HEARTBEAT_SUFFIX
        self._heartbeat_pub = self._own.create_publisher(Header, self.heartbeat_topic, 10)
        self._own.create_timer(HEARTBEAT_PERIOD_S, self._heartbeat)
        self._executor = SingleThreadedExecutor(context=node.context)
        self._executor.add_node(self._own)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, name="deadline-monitor", daemon=True)
        self._thread.start()
        self.scheduling = self._prioritize(thread_priority)

        self._jump_handle = self._clock.create_jump_callback(JumpThreshold(
            min_forward=Duration(seconds=CLOCK_JUMP_S), min_backward=Duration(nanoseconds=-1), on_clock_change=False),
            post_callback=self._on_clock_jump)

        # On the host's executor: outcomes of the timer.
        self._wake_host = node.create_guard_condition(self.deliver)

    def _spin(self) -> None:
        while not self._stop.is_set() and self._own.context.ok():
            try:
                spin_once(self._executor, SPIN_TIMEOUT_S, self._own.get_logger())
            except Exception:  # noqa: BLE001 - the context is shutting down under us
                if self._stop.is_set() or not self._own.context.ok():
                    return
                raise

    def _prioritize(self, priority: int) -> str:
        """Give the monitor's thread SCHED_FIFO `priority` (0: leave it); returns the policy it runs
        in, for /diagnostics. A refusal (EPERM without CAP_SYS_NICE or an rtprio limit, EINVAL
        for a priority outside 1-99, no such call off Linux) is logged once, not raised."""
        if priority == 0:
            return "SCHED_OTHER"
        try:
            os.sched_setscheduler(self._thread.native_id, os.SCHED_FIFO, os.sched_param(priority))
        except (OSError, AttributeError) as e:
            self._node.get_logger().warning(
                f"the deadline monitor's thread runs without real-time priority (SCHED_FIFO {priority} refused: "
                f"{e}): under CPU load its fallbacks can be late; grant CAP_SYS_NICE or an rtprio limit, "
                "or set monitor_thread_priority to 0 to silence this")
            return f"SCHED_OTHER (SCHED_FIFO {priority} refused)"
        return f"SCHED_FIFO {priority}"

    def _on_clock_jump(self, jump: TimeJump) -> None:
        """The host's clock jumped by `jump.delta`: open deadlines move with it (see the module docstring)."""
        with self._lock:
            self.counts["clock_jump"] += 1
            for d in self._pending.values():
                d.deadline += jump.delta
                if d.opened is not None:
                    d.opened += jump.delta

    def close(self) -> None:
        """Stop the monitor's thread and destroy its node (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._jump_handle.unregister()
        self._thread.join(2.0)
        self._executor.shutdown(0.5)
        self._own.destroy_node()

    @property
    def pending(self) -> int:
        """Number of open decisions."""
        return len(self._pending)

    def is_pending(self, decision_id: int) -> bool:
        """True while the decision is open (neither answered nor fallen back)."""
        return decision_id in self._pending

    def open(self, observation_stamp: Time) -> Decision:
        """Open a decision answering the observation stamped `observation_stamp`; its deadline is
        the stamp plus the budget."""
        with self._lock:
            now = self._clock.now()
            d = Decision(self._next_id, observation_stamp, observation_stamp + self.budget, now)
            if now > d.deadline:    # the host opened it on a reading already older than the budget
                self.counts["opened_after_deadline"] += 1
            self._next_id += 1
            self._pending[d.decision_id] = d
            return d

    def fail_now(self, observation_stamp: Time, reason: str) -> None:
        """Open a decision and answer it with the fallback at once (no engine, no sensor data, ...)."""
        with self._lock:
            d = self.open(observation_stamp)
            self._fall_back(self._pending.pop(d.decision_id), reason)
        self.deliver()

    def check(self) -> None:
        """Timer callback (monitor thread): every open decision past its deadline gets the
        fallback now, its lateness measured."""
        with self._lock:
            now = self._clock.now()
            expired = [d for d in self._pending.values() if now > d.deadline]
            for d in expired:
                self._fall_back(self._pending.pop(d.decision_id), "deadline_missed")
        if expired:
            self._wake_host.trigger()

    def resolve(self, result: ModelResult) -> ActionCommand | None:
        """Apply the engine's result for an open decision; returns the published model command,
        or None when the fallback was published or the result was dropped as late."""
        with self._lock:
            cmd = self._resolve(result)
        self.deliver()
        return cmd

    def _resolve(self, result: ModelResult) -> ActionCommand | None:
        d = self._pending.pop(result.decision_id, None)
        if d is None:
            late = self._expired.get(result.decision_id)
            if late is not None:
                self.counts["late_result_dropped"] += 1
                self._publish_status(late, None, met=False, fallback_used=True, reason="late_result_dropped")
            return None
        if result.ttft_s:
            self.ttft_s.append(result.ttft_s)
        if result.status != "ok" or result.tool_call is None:
            self._fall_back(d, result.status)
            return None
        if self._clock.now() > d.deadline:
            self._fall_back(d, "late_result_dropped")
            return None
        cmd = self._command(d, result.tool_call["name"], json.dumps(result.tool_call["arguments"]),
                            ActionCommand.SOURCE_MODEL, result.ttft_s)
        self._last_valid = (cmd.tool_name, cmd.arguments_json)
        self.counts["met"] += 1
        self._publish_status(d, cmd, met=True, fallback_used=False, reason="ok")
        return cmd

    def _fall_back(self, d: Decision, reason: str) -> None:
        if self.fallback == "last_valid" and self._last_valid is not None:
            tool, args = self._last_valid
        else:
            tool, args = ("stop", "{}") if self.fallback == "stop" else ("hold", "{}")
        cmd = self._command(d, tool, args, ActionCommand.SOURCE_FALLBACK, 0.0)
        self.counts["fallback"] += 1
        self.counts[reason] += 1
        if reason == "deadline_missed":   # the monitor's own lateness: from the deadline, or from the open
            due = d.deadline if d.opened is None or d.opened < d.deadline else d.opened
            late_s = (Time.from_msg(cmd.header.stamp, clock_type=d.deadline.clock_type) - due).nanoseconds * 1e-9
            self.fallback_lateness_s.append(late_s)
            if late_s > FALLBACK_BOUND_S:
                self.counts["fallback_late"] += 1
        self._expired[d.decision_id] = d
        while len(self._expired) > EXPIRED_KEPT:
            self._expired.popitem(last=False)
        self._publish_status(d, cmd, met=False, fallback_used=True, reason=reason)

    def _command(self, d: Decision, tool: str, args_json: str, source: str, ttft_s: float) -> ActionCommand:
        now = self._clock.now()
        cmd = ActionCommand(decision_id=d.decision_id, tool_name=tool, arguments_json=args_json,
                            source=source, observation_stamp=d.observation_stamp.to_msg(), ttft_s=ttft_s)
        cmd.header.stamp = now.to_msg()
        cmd.header.frame_id = self.frame_id
        cmd.decision_latency_s = (now - d.observation_stamp).nanoseconds * 1e-9
        self._action_pub.publish(cmd)
        self.counts["decisions"] += 1
        self.latency_s.append(cmd.decision_latency_s)
        return cmd

    def _publish_status(self, d: Decision, cmd: ActionCommand | None, *, met: bool, fallback_used: bool,
                        reason: str) -> None:
        now = self._clock.now()
        msg = DeadlineStatus(decision_id=d.decision_id, observation_stamp=d.observation_stamp.to_msg(),
                             deadline=d.deadline.to_msg(), met=met, fallback_used=fallback_used,
                             fallback=self.fallback if fallback_used else "", reason=reason,
                             latency_s=(now - d.observation_stamp).nanoseconds * 1e-9)
        msg.header.stamp = now.to_msg()
        self._status_pub.publish(msg)
        self._outcomes.append((cmd, msg))

    def deliver(self) -> None:
        """Host thread: run on_outcome for every outcome published so far, in order."""
        while self._outcomes:
            cmd, status = self._outcomes.popleft()
            if self._on_outcome is not None:
                self._on_outcome(cmd, status)

    def _heartbeat(self) -> None:
        """Monitor thread: one heartbeat while the host is active."""
        if self._active():
            msg = Header(frame_id=self._beat_frame)
            msg.stamp = self._clock.now().to_msg()
            self._heartbeat_pub.publish(msg)

    def _on_qos_deadline(self, event) -> None:
        self.counts["qos_deadline_missed"] = event.total_count

    def _on_incompatible_qos(self, event) -> None:
        self.counts["qos_incompatible"] = event.total_count
        self._node.get_logger().warning(
            f"a subscriber of the command topic requests incompatible QoS (policy {event.last_policy_kind})")

    def diagnostic_status(self, name: str) -> DiagnosticStatus:
        """Counts and latency percentiles (ms, observation stamp -> command) as a DiagnosticStatus.

        Level WARN when a fallback was published since the previous call, ERROR when an engine
        fault or a fallback later than FALLBACK_BOUND_S happened since then, OK otherwise.
        """
        with self._lock:
            counts, samples_of = self.counts.copy(), {"latency": list(self.latency_s), "ttft": list(self.ttft_s),
                                                      "fallback_lateness": list(self.fallback_lateness_s)}
        new = counts - self._reported
        self._reported = counts
        level = (DiagnosticStatus.ERROR if new["engine_fault"] or new["fallback_late"] else
                 DiagnosticStatus.WARN if new["fallback"] else DiagnosticStatus.OK)
        values = {k: str(counts[k]) for k in sorted(counts)}
        values["pending"] = str(self.pending)
        values["thread_scheduling"] = self.scheduling
        for label, samples in samples_of.items():
            if samples:
                p50, p90, p99 = np.percentile(np.asarray(samples), [50, 90, 99]) * 1e3
                values.update({f"{label}_p50_ms": f"{p50:.1f}", f"{label}_p90_ms": f"{p90:.1f}",
                               f"{label}_p99_ms": f"{p99:.1f}", f"{label}_max_ms": f"{max(samples) * 1e3:.1f}"})
        summary = (f"{counts['met']} met, {counts['fallback']} fallbacks ({counts['fallback_late']} later than "
                   f"{FALLBACK_BOUND_S * 1e3:.0f} ms), {counts['late_result_dropped']} late results dropped")
        return DiagnosticStatus(level=level, name=name, message=summary,
                                values=[KeyValue(key=k, value=v) for k, v in values.items()])
