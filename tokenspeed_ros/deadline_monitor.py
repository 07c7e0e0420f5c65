"""Deadline monitor: the only path by which the agent's commands reach the robot.

In the spirit of ros2_control's command timeouts: every decision is opened with a deadline
(observation stamp + budget). A valid model call that arrives before the deadline is published as
an `ActionCommand` (source "model"). Otherwise - the deadline passes (checked by a ROS timer), the
engine returns no valid call, or the engine faults - the configured safe fallback is published
(source "fallback": "hold", "stop" or "last_valid" = the last valid model call again, "hold" if
there was none). A model result that arrives after its fallback went out is dropped, never
executed, and reported with reason "late_result_dropped". Each outcome is a `DeadlineStatus`.

The command publisher also offers a QoS deadline (`qos_deadline_s`); the DDS layer reports
periods without any command, which are counted (`qos_deadline_missed`). Everything is counted
and exposed by `diagnostic_status()` for /diagnostics.
"""
from __future__ import annotations

import json
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue
from rclpy.duration import Duration
from rclpy.event_handler import PublisherEventCallbacks
from rclpy.qos import QoSProfile, ReliabilityPolicy
from rclpy.time import Time
from tokenspeed_msgs.msg import ActionCommand, DeadlineStatus

FALLBACKS = ("hold", "stop", "last_valid")
LATENCY_WINDOW = 1000          # decisions kept for the latency percentiles
EXPIRED_KEPT = 256             # expired decisions remembered to flag their late results


@dataclass
class Decision:
    """One open decision: id, the stamp of the observation it answers and its absolute deadline."""

    decision_id: int
    observation_stamp: Time
    deadline: Time


@dataclass
class ModelResult:
    """What the engine returned for a decision.

    status: "ok", "deadline_missed", "invalid", "text" (as tokenspeed Decision.status) or
    "engine_fault" (decide() raised or no engine). tool_call: {"name", "arguments"} when "ok".
    ttft_s / total_s: engine time to first token and decide() duration, seconds.
    """

    decision_id: int
    status: str
    tool_call: dict | None = None
    reason: str = ""
    ttft_s: float = 0.0
    total_s: float = 0.0


class DeadlineMonitor:
    """Publishes model calls that meet their deadline, and the safe fallback for every other decision.

    node: the rclpy Node that owns the publishers and the timer; budget_s: observation stamp ->
    action deadline (seconds); fallback: one of FALLBACKS; period_s: timer period (seconds);
    qos_deadline_s: QoS deadline offered on the command topic (0 disables); on_outcome: called
    after every DeadlineStatus is published, as on_outcome(command, status) with the
    ActionCommand published for that decision, or None for a late result dropped after its
    fallback went out. Not thread-safe: call from the node's executor thread (on_outcome runs
    there too). Raises ValueError for an unknown fallback.
    """

    def __init__(self, node, *, action_topic: str, status_topic: str, budget_s: float, fallback: str,
                 period_s: float, qos_depth: int = 10, qos_deadline_s: float = 0.0,
                 on_outcome: Callable[[ActionCommand | None, DeadlineStatus], None] | None = None):
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback {fallback!r} is not one of {FALLBACKS}")
        self._node = node
        self._clock = node.get_clock()
        self.budget = Duration(seconds=budget_s)
        self.fallback = fallback
        self._on_outcome = on_outcome
        qos = QoSProfile(depth=qos_depth, reliability=ReliabilityPolicy.RELIABLE)
        if qos_deadline_s > 0:
            qos.deadline = Duration(seconds=qos_deadline_s)
        self._action_pub = node.create_publisher(
            ActionCommand, action_topic, qos,
            event_callbacks=PublisherEventCallbacks(deadline=self._on_qos_deadline,
                                                    incompatible_qos=self._on_incompatible_qos))
        self._status_pub = node.create_publisher(DeadlineStatus, status_topic, 10)
        self._timer = node.create_timer(period_s, self.check)   # runs only while decisions are open
        self._timer.cancel()
        self._next_id = 1
        self._pending: dict[int, Decision] = {}
        self._expired: OrderedDict[int, Decision] = OrderedDict()
        self._last_valid: tuple[str, str] | None = None     # (tool name, arguments JSON)
        self.counts: Counter[str] = Counter()               # outcomes and reasons, see diagnostic_status
        self.latency_s: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.ttft_s: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._reported: Counter[str] = Counter()

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
        d = Decision(self._next_id, observation_stamp, observation_stamp + self.budget)
        self._next_id += 1
        self._pending[d.decision_id] = d
        if self._timer.is_canceled():
            self._timer.reset()
        return d

    def fail_now(self, observation_stamp: Time, reason: str) -> None:
        """Open a decision and answer it with the fallback at once (no engine, no sensor data, ...)."""
        d = self.open(observation_stamp)
        self._fall_back(self._pending.pop(d.decision_id), reason)

    def check(self) -> None:
        """Timer callback: every open decision past its deadline gets the fallback now; the
        timer stops when no decision is open."""
        now = self._clock.now()
        for d in [d for d in self._pending.values() if now > d.deadline]:
            self._fall_back(self._pending.pop(d.decision_id), "deadline_missed")
        if not self._pending:
            self._timer.cancel()

    def resolve(self, result: ModelResult) -> ActionCommand | None:
        """Apply the engine's result for an open decision; returns the published model command,
        or None when the fallback was published or the result was dropped as late."""
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
        self._expired[d.decision_id] = d
        while len(self._expired) > EXPIRED_KEPT:
            self._expired.popitem(last=False)
        self._publish_status(d, cmd, met=False, fallback_used=True, reason=reason)

    def _command(self, d: Decision, tool: str, args_json: str, source: str, ttft_s: float) -> ActionCommand:
        now = self._clock.now()
        cmd = ActionCommand(decision_id=d.decision_id, tool_name=tool, arguments_json=args_json,
                            source=source, observation_stamp=d.observation_stamp.to_msg(), ttft_s=ttft_s)
        cmd.header.stamp = now.to_msg()
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
        if self._on_outcome is not None:
            self._on_outcome(cmd, msg)

    def _on_qos_deadline(self, event) -> None:
        self.counts["qos_deadline_missed"] = event.total_count

    def _on_incompatible_qos(self, event) -> None:
        self.counts["qos_incompatible"] = event.total_count
        self._node.get_logger().warning(
            f"a subscriber of the command topic requests incompatible QoS (policy {event.last_policy_kind})")

    def diagnostic_status(self, name: str) -> DiagnosticStatus:
        """Counts and latency percentiles (ms, observation stamp -> command) as a DiagnosticStatus.

        Level WARN when a fallback was published since the previous call, ERROR when an engine
        fault happened since then, OK otherwise.
        """
        new = self.counts - self._reported
        self._reported = self.counts.copy()
        level = (DiagnosticStatus.ERROR if new["engine_fault"] else
                 DiagnosticStatus.WARN if new["fallback"] else DiagnosticStatus.OK)
        values = {k: str(self.counts[k]) for k in sorted(self.counts)}
        values["pending"] = str(self.pending)
        for label, samples in (("latency", self.latency_s), ("ttft", self.ttft_s)):
            if samples:
                p50, p90, p99 = np.percentile(np.asarray(samples), [50, 90, 99]) * 1e3
                values.update({f"{label}_p50_ms": f"{p50:.1f}", f"{label}_p90_ms": f"{p90:.1f}",
                               f"{label}_p99_ms": f"{p99:.1f}", f"{label}_max_ms": f"{max(samples) * 1e3:.1f}"})
        summary = (f"{self.counts['met']} met, {self.counts['fallback']} fallbacks, "
                   f"{self.counts['late_result_dropped']} late results dropped")
        return DiagnosticStatus(level=level, name=name, message=summary,
                                values=[KeyValue(key=k, value=v) for k, v in values.items()])
