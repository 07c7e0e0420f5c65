"""Closed-loop latency harness: a ROS 2 peer that only listens, and reports every decision's
latency from sensor capture to the action being applied on the (simulated) robot.

It never imports `tokenspeed`: everything comes from topics, and all stamps are wall-clock on one
host (see `tokenspeed_sim.sim_node`). Per decision (one ActionCommand, keyed by decision_id):

  capture      ActionCommand.observation_stamp: the sensor reading the decision answers
  in context   receive time here of the first agent/observation echo (published by the agent once
               observe() has put a reading into the KV cache) stamped at or after the capture stamp
               (1 ms slack): agents coalesce readings, so a newer reading may stand in for it.
               None when no such echo arrived before the command did.
  first token  ActionCommand.ttft_s: decide()'s time to first token
  published    ActionCommand.header.stamp
  applied      ActionFeedback(state="applied").header.stamp from the simulator

Stages reported (seconds): capture->context, ttft, capture->published, published->applied and
end-to-end (capture->applied), each with p50/p90/p99/max; the agent's per-stage trace of each
decision (`agent/action/trace`, JSON: sensor stamp -> received -> perception done -> queued ->
prefill start/end -> decide start -> first token -> end -> published; tokens that entered the
context for it; whether it was decided ahead) with the robot's "applied" as the last stage, its
p50s, tokens per decision, decided-ahead hits and misses and, for hits, the robot's "done" of the
call before -> the command published; plus deadline hit rate and fallbacks
(tokenspeed_msgs/DeadlineStatus; the model's task_done, a start-up no_sensor_data hold and a decision
withdrawn with its fallback on time, e.g. superseded by a new task, are not decisions and are counted
apart), decisions per second, feedback counts, and the task outcome
from `sim/scenario_status`. Outputs: report.json, latency.png and a printed table.

The measured window can start when the agent's engine reports "ready" on /diagnostics
(`--wait-engine`), so model loading does not fill the statistics with "engine_loading"
fallbacks; those are summarised separately. The engine's ready time is the one its status carries
("ready at"), and /diagnostics is subscribed transient-local (latched, as the agents publish it),
so a status published before DDS discovery matched this listener still arrives, with its time. The agent's start-up stages from its process start
to the engine ready (its "startup: ..." values on /diagnostics) are reported beside it.
"""
from __future__ import annotations

import argparse
import bisect
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from std_msgs.msg import String
from rclpy.action import ActionClient
from tokenspeed_msgs.action import RunTask
from tokenspeed_msgs.msg import ActionCommand, ActionFeedback, DeadlineStatus, Observation

from tokenspeed_sim import ros_spin

STAGES = ("capture_to_context_s", "ttft_s", "capture_to_published_s", "published_to_applied_s", "end_to_end_s")
MAX_REMEMBERED_OBSERVATIONS = 5000
TASK_RESEND_S = 0.2         # a RunTask goal the agent rejected (not yet active) is sent again after this (s)
WITHDRAWN = ("superseded", "cancelled", "deactivated")   # reasons of decisions their owner withdrew
ECHO_MATCH_NS = 1_000_000   # slack when comparing echo stamps with observation stamps (agents may round-trip float seconds)


def _secs(stamp) -> float:
    """builtin_interfaces/Time -> seconds (float)."""
    return stamp.sec + stamp.nanosec * 1e-9


def _ns(stamp) -> int:
    return stamp.sec * 1_000_000_000 + stamp.nanosec


@dataclass
class Decision:
    """One published action and what happened to it. Times are wall-clock seconds (epoch)."""

    decision_id: int
    source: str                      # "model" or "fallback"
    tool: str
    arguments: str
    capture: float                   # observation stamp
    capture_ns: int                  # the same stamp in integer nanoseconds (matches echoes exactly)
    published: float                 # ActionCommand header stamp
    received: float                  # when the harness got the command
    ttft_s: float
    in_context: float | None = None  # receive time of the matching observation echo
    trace: dict | None = None        # the agent's per-stage trace of it (agent/action/trace), if any
    applied: float | None = None
    outcome: str = ""                # last feedback state: applied / done / preempted / rejected
    detail: str = ""

    def stages(self) -> dict[str, float | None]:
        """This decision's stage latencies in seconds (None where a stamp is missing)."""
        return {
            "capture_to_context_s": None if self.in_context is None else self.in_context - self.capture,
            "ttft_s": self.ttft_s if self.source == "model" else None,
            "capture_to_published_s": self.published - self.capture,
            "published_to_applied_s": None if self.applied is None else self.applied - self.published,
            "end_to_end_s": None if self.applied is None else self.applied - self.capture,
        }


def startup_stages(values, clock_start: float) -> dict | None:
    """An agent's start-up from its engine status's /diagnostics values ("startup: process started"
    = epoch seconds, "startup: <stage>" = "<wall s> <CPU s>"): {"process_started_s": its process
    start on the clock that began at `clock_start` (epoch seconds), "stages": [{"stage", "wall_s",
    "cpu_s"}] in order}; None when the agent sends none."""
    found = {kv.key.removeprefix("startup: "): kv.value for kv in values if kv.key.startswith("startup: ")}
    if "process started" not in found:
        return None
    started = float(found.pop("process started"))
    stages = [{"stage": name, "wall_s": float(v.split()[0]), "cpu_s": float(v.split()[1])} for name, v in found.items()]
    return {"process_started_s": started - clock_start, "stages": stages}


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """{n, mean, p50, p90, p99, max} of seconds values (None entries when empty)."""
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(a.max())}


class LatencyHarness(Node):
    """Listens to the agent's and the simulator's topics and records every decision; with
    live=True it also prints one line per action, rejection and task-outcome change."""

    def __init__(self, live: bool = False, **node_kwargs):
        super().__init__("tokenspeed_latency_harness", **node_kwargs)
        self.live = live
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.decisions: dict[int, Decision] = {}
        self.deadlines: dict[int, DeadlineStatus] = {}
        self._printed: set[int] = set()     # decisions whose live line is out
        self.duplicate_ids = 0
        self.scenario: dict | None = None
        self.first_success_at: float | None = None   # wall time the task was first achieved
        self.started = time.time()
        self.window_start = self.started        # decisions received before this are not in the stats
        self.engine_ready_at: float | None = None
        self.agent_active = False               # the agent's engine status says "active": it accepts tasks
        self.startup: dict | None = None        # the agent's start-up stages (see `startup_stages`)
        self._echoes: dict[int, float] = {}     # observation stamp (ns) -> receive time here
        self._echo_keys: list[int] = []         # the same stamps, sorted
        self.first_echo_at: float | None = None  # receive time of the agent's first observation echo
        self._feedback: dict[int, list[tuple[str, float, str]]] = {}   # decision id -> (state, stamp, detail)
        self.create_subscription(Observation, "agent/observation", self._on_observation, 100)
        self.create_subscription(ActionCommand, "agent/action", self._on_action, 100)
        self.create_subscription(String, "agent/action/trace", self._on_trace, 100)
        self._traces: dict[int, dict] = {}      # decision id -> the agent's trace record
        self.create_subscription(DeadlineStatus, "agent/deadline_status", self._on_deadline, 100)
        self.create_subscription(ActionFeedback, "sim/action_feedback", self._on_feedback, 100)
        self.create_subscription(String, "sim/scenario_status", self._on_status, latched)
        # latched, as the agents publish it: the latest status arrives however late this listener is matched
        self.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, latched)
        self.create_subscription(String, "goal", self._on_goal, latched)
        self.goal_text = ""                     # the task the simulator asks for (its goal topic)
        self.run_task: dict | None = None       # the RunTask goal sent to the agent and its result
        self._task_client = ActionClient(self, RunTask, "run_task")

    def _on_goal(self, msg: String) -> None:
        self.goal_text = msg.data

    def send_task(self) -> bool:
        """Send the simulator's goal to the agent as a RunTask action goal once the goal, the
        agent's action server and its "active" status on /diagnostics are known (an agent accepts
        goals only once active, a moment after its engine is ready; it says so at once), again
        every TASK_RESEND_S while the agent rejects it; returns whether the agent accepted it. Its
        feedback and result are recorded in `run_task` ("rejected": goals rejected before)."""
        run = self.run_task
        if run is not None and run["accepted"]:
            return True
        if run is not None and (run["accepted"] is None or time.time() - self.started - run["sent_s"] < TASK_RESEND_S):
            return False
        if not self.goal_text or not self.agent_active or not self._task_client.server_is_ready():
            return False
        self.run_task = {"task": self.goal_text, "sent_s": time.time() - self.started, "feedback": 0,
                         "accepted": None, "outcome": None, "rejected": 0 if run is None else run["rejected"] + 1}
        sent = self._task_client.send_goal_async(RunTask.Goal(task=self.goal_text), feedback_callback=self._on_task_feedback)
        sent.add_done_callback(self._on_task_accepted)
        return False

    def _on_task_feedback(self, _msg) -> None:
        self.run_task["feedback"] += 1

    def _on_task_accepted(self, future) -> None:
        handle = future.result()
        self.run_task["accepted"] = bool(handle.accepted)
        if handle.accepted:
            handle.get_result_async().add_done_callback(self._on_task_result)

    def _on_task_result(self, future) -> None:
        r = future.result().result
        self.run_task.update(outcome=r.outcome, evidence=r.evidence, decisions=r.decisions, duration_s=r.duration_s,
                             result_s=time.time() - self.started)
        if self.live:
            print(f"[{time.time() - self.started:6.1f} s] RunTask {r.outcome} after {r.decisions} decisions: "
                  f"{r.evidence}", flush=True)

    def _on_observation(self, msg: Observation) -> None:
        key = _ns(msg.header.stamp)
        if self.first_echo_at is None:
            self.first_echo_at = time.time()
        if key not in self._echoes:
            self._echoes[key] = time.time()
            bisect.insort(self._echo_keys, key)
            if len(self._echo_keys) > MAX_REMEMBERED_OBSERVATIONS:
                del self._echoes[self._echo_keys.pop(0)]

    def _echo_time(self, stamp_ns: int, before: float) -> float | None:
        """When the context first held a reading at least as new as stamp_ns: the earliest
        receive time (not after `before`) of an echo stamped >= stamp_ns - ECHO_MATCH_NS, or None."""
        i = bisect.bisect_left(self._echo_keys, stamp_ns - ECHO_MATCH_NS)
        times = [self._echoes[k] for k in self._echo_keys[i:i + 500]]
        first = min(times, default=None)
        return first if first is not None and first <= before else None

    def _on_action(self, msg: ActionCommand) -> None:
        if msg.decision_id in self.decisions:
            self.duplicate_ids += 1
            return
        self.decisions[msg.decision_id] = Decision(
            decision_id=msg.decision_id, source=msg.source, tool=msg.tool_name, arguments=msg.arguments_json,
            capture=_secs(msg.observation_stamp), capture_ns=_ns(msg.observation_stamp),
            published=_secs(msg.header.stamp), received=time.time(), ttft_s=msg.ttft_s)
        self._print_decision(msg.decision_id)

    def _print_decision(self, decision_id: int) -> None:
        """The live line of a decision, once: a model call's at once, a fallback's once its
        DeadlineStatus says why it went out (e.g. "task_done": the model called task_done)."""
        d, status = self.decisions.get(decision_id), self.deadlines.get(decision_id)
        if not self.live or d is None or decision_id in self._printed or (d.source != "model" and status is None):
            return
        self._printed.add(decision_id)
        why = f" ({status.reason})" if d.source != "model" else ""
        source, call = d.source, f"{d.tool}({d.arguments}){why}"
        if d.source != "model" and status.reason == "task_done":   # the model's own call; the arm holds
            source, call = "model", f"task_done -> {d.tool}({d.arguments})"
        print(f"[{d.received - self.started:6.1f} s] decision {d.decision_id:<4} {source:<8} "
              f"{call}  sensor->published {(d.published - d.capture) * 1e3:.0f} ms", flush=True)

    def _on_trace(self, msg: String) -> None:
        try:
            record = json.loads(msg.data)
            self._traces[int(record["decision_id"])] = record
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            self.get_logger().warning("agent/action/trace: not a trace record; ignored")

    def _on_deadline(self, msg: DeadlineStatus) -> None:
        self.deadlines[msg.decision_id] = msg
        self._print_decision(msg.decision_id)

    def _on_feedback(self, msg: ActionFeedback) -> None:
        self._feedback.setdefault(msg.decision_id, []).append((msg.state, _secs(msg.header.stamp), msg.detail))
        if self.live and msg.state == "rejected":
            print(f"[{time.time() - self.started:6.1f} s] decision {msg.decision_id:<4} rejected by the robot: "
                  f"{msg.detail}", flush=True)

    def _on_status(self, msg: String) -> None:
        try:
            status = json.loads(msg.data)
        except json.JSONDecodeError:
            self.get_logger().warning("sim/scenario_status is not JSON; ignored")
            return
        if self.live and (self.scenario or {}).get("success") != status.get("success"):
            state = "SUCCESS" if status.get("success") else "set" if self.scenario is None else "no longer achieved"
            print(f"[{time.time() - self.started:6.1f} s] task {state}: {status.get('goal')}", flush=True)
        if status.get("success") and self.first_success_at is None:
            self.first_success_at = time.time()
        self.scenario = status

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        """Notes when an agent's engine first reports state "ready" (status "<node>: engine"): at its
        "ready at" value (epoch seconds: when it became ready, however late this status arrives), or
        when the status arrives for an agent that sends none; and whether the agent is active (its
        latest engine status's "active")."""
        for st in msg.status:
            if st.name.endswith(": engine"):
                self.agent_active = any(kv.key == "active" and kv.value == "true" for kv in st.values)
            if self.engine_ready_at is None and st.name.endswith(": engine") and \
                    any(kv.key == "state" and kv.value == "ready" for kv in st.values):
                ready_at = next((kv.value for kv in st.values if kv.key == "ready at"), None)
                self.engine_ready_at = time.time() if ready_at is None else float(ready_at)
                self.startup = startup_stages(st.values, self.started)
                if self.live:
                    print(f"[{self.engine_ready_at - self.started:6.1f} s] {st.name.split(':')[0]} engine ready", flush=True)

    def _not_a_decision(self, status: DeadlineStatus, decision: Decision) -> str | None:
        """Why `status` is not a deadline decision (kept out of the hit rate, neither met nor missed),
        or None when it counts: "task_done", the model's own completion call (the task is over and the
        arm holds by design); "no_sensor_data" received before the agent's first observation echo (a
        hold with nothing yet to decide on; a later sensor outage still counts as a miss); a decision
        withdrawn by its owner (WITHDRAWN: a new task superseded it, the task was cancelled, the node
        deactivated) whose safe fallback went out by its deadline (one published after it is a miss)."""
        if status.reason == "task_done":
            return "task_done"
        if status.reason in WITHDRAWN and _ns(status.header.stamp) <= _ns(status.deadline):
            return status.reason
        if status.reason == "no_sensor_data" and (self.first_echo_at is None or decision.received < self.first_echo_at):
            return "no_sensor_data"
        return None

    # ------------------------------------------------------------------ report
    def report(self) -> dict:
        """The run so far as a JSON-ready dict (seconds throughout). Statistics cover decisions
        received from `window_start` on; earlier ones are summarised under "before_window"."""
        duration = max(1e-9, time.time() - self.window_start)
        everything = list(self.decisions.values())
        decisions = [d for d in everything if d.received >= self.window_start]
        early = [d for d in everything if d.received < self.window_start]
        done_stamps = sorted(stamp for i, fb in self._feedback.items() for state, stamp, _ in fb
                             if state == "done" and i in self.decisions and self.decisions[i].source == "model")
        for d in everything:   # echoes, commands and feedback come from different writers, in any order
            d.in_context = self._echo_time(d.capture_ns, before=d.received)
            d.trace = self._traces.get(d.decision_id)
            for state, stamp, detail in self._feedback.get(d.decision_id, []):
                if state == "applied" and d.applied is None:
                    d.applied = stamp
                d.outcome, d.detail = state, detail
        model = [d for d in decisions if d.source == "model"]
        stage_values = {s: [] for s in STAGES}
        for d in model:
            for s, v in d.stages().items():
                if v is not None:
                    stage_values[s].append(v)
        in_window = {d.decision_id: d for d in decisions}
        statuses, not_decisions = [], Counter()
        for i, s in self.deadlines.items():
            if i in in_window:
                kind = self._not_a_decision(s, in_window[i])
                if kind:
                    not_decisions[kind] += 1
                else:
                    statuses.append(s)
        met = sum(1 for s in statuses if s.met)
        return {
            "duration_s": duration,
            "engine_ready_after_s": None if self.engine_ready_at is None else self.engine_ready_at - self.started,
            "startup": self.startup,
            "before_window": {"decisions": len(early), "fallbacks": sum(1 for d in early if d.source == "fallback"),
                              "reasons": dict(Counter(self.deadlines[d.decision_id].reason for d in early
                                                      if d.decision_id in self.deadlines))},
            "decisions": len(decisions),
            "model_decisions": len(model),
            "fallbacks": sum(1 for d in decisions if d.source == "fallback"),
            "decisions_per_s": len(decisions) / duration,
            "stages": {s: percentiles(v) for s, v in stage_values.items()},
            "fallback_end_to_end_s": percentiles([d.stages()["end_to_end_s"] for d in decisions
                                                  if d.source == "fallback" and d.applied is not None]),
            "deadline": {
                "statuses": len(statuses), "met": met, "missed": len(statuses) - met,
                "hit_rate": met / len(statuses) if statuses else None,
                "fallback_used": sum(1 for s in statuses if s.fallback_used),
                "reasons": dict(Counter(s.reason for s in statuses)),
                "not_decisions": dict(not_decisions),
            },
            "feedback": dict(Counter(state for i in in_window for state, _, _ in self._feedback.get(i, []))),
            "duplicate_decision_ids": self.duplicate_ids,
            "observation_echoes": len(self._echo_keys),
            "trace": trace_summary(decisions, done_stamps),
            "task_time_s": None if self.first_success_at is None or self.engine_ready_at is None
            else self.first_success_at - self.engine_ready_at,
            "run_task": self.run_task,
            # RunTask goal sent (the accepted one) -> the agent's first model command for it
            "task_to_first_command_s": None if self.run_task is None else min(
                (d.published - self.started - self.run_task["sent_s"] for d in model
                 if d.published >= self.started + self.run_task["sent_s"]), default=None),
            "task": None if self.scenario is None else {
                **self.scenario, "first_success_s": None if self.first_success_at is None
                else self.first_success_at - self.started},
            "per_decision": [{**asdict(d), **d.stages(), "in_window": d.received >= self.window_start}
                             for d in everything],
        }


def trace_summary(decisions: list[Decision], done_stamps: list[float]) -> dict:
    """The agent's per-stage traces of `decisions`: p50 ms per stage of the model calls with the
    robot's "applied" added as `published_to_applied`; over every decision the engine took (a
    model call, or a fallback whose result came late): tokens that entered the context per
    decision, decided-ahead hits and misses; for hits the latency from the robot's last "done"
    of a model call before the command to the command's publish time (`done_stamps`: those sorted
    "done" stamps, s; a task's first call, decided ahead on a camera frame, has none before it)."""
    engine = [d for d in decisions if d.trace is not None and d.trace["times"].get("queued")]
    traced = [d for d in decisions if d.trace is not None and d.source == "model"]
    stages: dict[str, list[float]] = {}
    for d in traced:
        applied = None if d.applied is None else (d.applied - d.published) * 1e3
        for s, v in {**d.trace["stages_ms"], "published_to_applied": applied}.items():
            if v is not None:
                stages.setdefault(s, []).append(v)
    feedback_to_command = []
    for d in traced:
        i = bisect.bisect_right(done_stamps, d.published)
        if d.trace.get("ahead") == "hit" and i:
            feedback_to_command.append(d.published - done_stamps[i - 1])
    tokens = [d.trace["tokens_in"] for d in engine]
    after = [d.trace["times"].get("request_tokens", 0) for d in engine]
    return {
        "decisions": len(traced),
        "engine_decisions": len(engine),
        "stages_p50_ms": {s: float(np.median(v)) for s, v in stages.items()},
        "tokens_per_decision": tokens,
        "tokens_per_decision_p50": float(np.median(tokens)) if tokens else None,
        "tokens_per_decision_mean": float(np.mean(tokens)) if tokens else None,
        "tokens_after_reading": after,      # prefilled between the decision's request and its call
        "tokens_after_reading_p50": float(np.median(after)) if after else None,
        "decided_ahead": dict(Counter(d.trace.get("ahead") or "none" for d in engine)),
        "feedback_to_command_s": percentiles(feedback_to_command),
    }


def write_plot(report: dict, path: Path) -> None:
    """PNG with latency over time (left) and the distribution per stage (right), milliseconds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["per_decision"] if r["in_window"]]
    t0 = min((r["published"] for r in rows), default=0.0)
    fig, (ax_t, ax_d) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for color, stage in enumerate(("end_to_end_s", "capture_to_published_s", "ttft_s", "published_to_applied_s")):
        for source, marker in (("model", "o"), ("fallback", "x")):
            pts = [(r["published"] - t0, r[stage] * 1e3) for r in rows if r["source"] == source and r[stage] is not None]
            if pts:
                x, y = zip(*pts)
                ax_t.plot(x, y, marker=marker, linestyle="-" if source == "model" else "none", color=f"C{color}",
                          markersize=4 if source == "model" else 7, linewidth=0.8, label=f"{stage[:-2]} ({source})")
    ax_t.set_xlabel("time since first decision (s)")
    ax_t.set_ylabel("latency (ms)")
    ax_t.set_title("per-decision latency over time")
    ax_t.grid(alpha=0.3)
    ax_t.legend(fontsize=7)
    data = {s[:-2]: [r[s] * 1e3 for r in rows if r["source"] == "model" and r[s] is not None] for s in reversed(STAGES)}
    data = {k: v for k, v in data.items() if v}
    if data:
        ax_d.boxplot(list(data.values()), vert=False, whis=(0, 100))
        ax_d.set_yticks(range(1, len(data) + 1), list(data.keys()), fontsize=8)
    else:
        ax_d.text(0.5, 0.5, "no model decisions in the measured window", ha="center", va="center",
                  transform=ax_d.transAxes)
        ax_d.set_xticks([])
        ax_d.set_yticks([])
    ax_d.set_xlabel("latency (ms), whiskers = min/max")
    hit = report["deadline"]["hit_rate"]
    task = report["task"] or {}
    ax_d.set_title(f"distribution (model decisions)  hit rate {'-' if hit is None else f'{hit:.0%}'}"
                   f"  task {'success' if task.get('success') else 'not done'}", fontsize=9)
    ax_d.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(report: dict) -> None:
    """Print the latency table, deadline figures and task outcome (rich)."""
    from rich.console import Console
    from rich.table import Table

    def ms(v):
        return "-" if v is None else f"{v * 1e3:.1f}"

    table = Table(title=f"closed-loop latency, {report['decisions']} decisions in {report['duration_s']:.0f} s "
                        f"({report['decisions_per_s']:.2f}/s)")
    for col in ("stage", "n", "p50 ms", "p90 ms", "p99 ms", "max ms"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for stage, st in report["stages"].items():
        table.add_row(stage[:-2], str(st["n"]), ms(st["p50"]), ms(st["p90"]), ms(st["p99"]), ms(st["max"]))
    fb = report["fallback_end_to_end_s"]
    table.add_row("fallback end_to_end", str(fb["n"]), ms(fb["p50"]), ms(fb["p90"]), ms(fb["p99"]), ms(fb["max"]))
    console = Console()
    console.print(table)
    up = report.get("startup")
    if up is not None:
        ready = report["engine_ready_after_s"]
        stages = Table(title=f"agent start-up: process started {up['process_started_s']:.2f} s into the run, engine "
                             f"ready {ready:.2f} s (CPU: the agent's process, every thread)")
        for col in ("stage", "wall s", "CPU s"):
            stages.add_column(col, justify="left" if col == "stage" else "right")
        for st in up["stages"]:
            stages.add_row(st["stage"], f"{st['wall_s']:.2f}", f"{st['cpu_s']:.2f}")
        stages.add_row("total", f"{sum(st['wall_s'] for st in up['stages']):.2f}",
                       f"{sum(st['cpu_s'] for st in up['stages']):.2f}")
        console.print(stages)
    tr = report.get("trace") or {}
    if tr.get("decisions"):
        ahead = (tr.get("decided_ahead") or {}).get("hit", 0)
        stages = Table(title=f"per-stage trace of {tr['decisions']} model decisions (the agent's agent/action/trace)")
        stages.add_column("stage")
        stages.add_column("p50 ms", justify="right")
        for name, v in tr["stages_p50_ms"].items():
            stages.add_row(name, f"{v:.1f}")
        console.print(stages)
        if ahead:
            console.print(f"{ahead} of them decided ahead: their prefill, ttft and decode ran before the reading (0 ms here)")
        fc = tr["feedback_to_command_s"]
        console.print(f"tokens into the context per engine decision: {tr['tokens_per_decision']} (p50 "
                      f"{tr['tokens_per_decision_p50']:.0f}), of them prefilled after the decision's reading: "
                      f"{tr['tokens_after_reading']} (p50 {tr['tokens_after_reading_p50']:.0f}); "
                      f"decided ahead: {tr['decided_ahead']}; robot done -> "
                      f"command published for decided-ahead calls: p50 {ms(fc['p50'])} ms (n {fc['n']})")
    dl = report["deadline"]
    hit = "-" if dl["hit_rate"] is None else f"{dl['hit_rate']:.1%}"
    console.print(f"deadline: {dl['met']}/{dl['statuses']} met (hit rate {hit}), deadline statuses by reason "
                  f"{dl['reasons']}, safe fallbacks published {report['fallbacks']}"
                  + (f"; not decisions (not counted) {dl['not_decisions']}" if dl["not_decisions"] else ""))
    early = report["before_window"]
    if early["decisions"]:
        ready = report["engine_ready_after_s"]
        console.print(f"before the measured window (engine {'not ready' if ready is None else f'ready after {ready:.0f} s'}): "
                      f"{early['decisions']} actions, {early['fallbacks']} fallbacks, reasons {early['reasons']}")
    console.print(f"robot feedback: {report['feedback']}")
    task = report["task"]
    if task is None:
        console.print("task: no sim/scenario_status received")
    else:
        console.print(f"task: {task['goal']}\n  -> {'SUCCESS' if task['success'] else 'not achieved'}: "
                      f"{task['target_object']} {task['distance_m'] * 100:.1f} cm from the target "
                      f"(tolerance {task['tolerance_m'] * 100:.0f} cm), holding {task['holding']}, "
                      f"commands accepted {task['commands_accepted']}, rejected {task['commands_rejected']}")
        if task.get("first_success_s") is not None:
            state = "and still achieved at the end" if task["success"] else "then undone by later actions"
            console.print(f"  first achieved {task['first_success_s']:.1f} s into the run ({state})"
                          + ("" if report.get("task_time_s") is None
                             else f"; task time (engine ready -> achieved) {report['task_time_s']:.1f} s"))
    run = report.get("run_task")
    if run is not None:
        console.print(f"RunTask action: sent {run['sent_s']:.1f} s into the run"
                      + (f" (after {run['rejected']} rejected while the agent was not yet active)"
                         if run.get("rejected") else "")
                      + ("" if report.get("task_to_first_command_s") is None
                         else f", first command {report['task_to_first_command_s'] * 1e3:.0f} ms after it")
                      + f", {run['feedback']} feedback messages, "
                      f"outcome {run['outcome'] or 'none yet'}"
                      + (f" after {run['decisions']} decisions: {run['evidence']}" if run["outcome"] else ""))


def write_outputs(report: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write report.json and latency.png into out_dir (created); returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "report.json", out_dir / "latency.png"
    json_path.write_text(json.dumps(report, indent=2))
    write_plot(report, png_path)
    return json_path, png_path


def listen(duration_s: float, out_dir: Path, stop=None, live: bool = False, wait_engine_s: float = 0.0,
           task: bool = False) -> dict:
    """Run the harness in this process (rclpy must not be initialised yet), write the outputs,
    print the table and return the report.

    wait_engine_s > 0: first wait up to that many seconds for an agent's engine to report ready
    on /diagnostics; the measured window of duration_s seconds starts then (or at the timeout).
    Ends early when `stop()` returns True or on SIGINT, reporting what was seen. live: print each
    decision as it arrives. task: when the window starts, send the simulator's goal to the agent as
    a RunTask action goal (for up to 30 s until the agent accepts it) and report its outcome.
    """
    ros_spin.init()
    harness = LatencyHarness(live=live)
    spinner = ros_spin.Spinner(harness)
    try:
        why = "duration"
        if wait_engine_s > 0:
            why = spinner.spin(wait_engine_s, until=lambda: harness.engine_ready_at is not None or bool(stop and stop()))
            harness.window_start = time.time()
            if why == "duration":
                print(f"no engine ready within {wait_engine_s:g} s; measuring anyway", flush=True)
        if task and why in ("duration", "until"):
            spinner.spin(30.0, until=lambda: harness.send_task() or bool(stop and stop()))
        if why in ("duration", "until") and not (stop and stop()):
            spinner.spin(duration_s, until=stop)
        report = harness.report()
    finally:
        spinner.close()
        harness.destroy_node()
        rclpy.try_shutdown()
    paths = write_outputs(report, out_dir)
    print_table(report)
    print(f"report: {paths[0]}\nplot:   {paths[1]}")
    return report


def main(argv: list[str] | None = None) -> None:
    """Console entry point `tokenspeed_sim_harness`: listen for --duration seconds, then report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds to listen (default 60)")
    ap.add_argument("--out", type=Path, default=Path("out/latency"), help="folder for report.json and latency.png")
    ap.add_argument("--live", action="store_true", help="print each decision as it arrives")
    ap.add_argument("--wait-engine", type=float, default=0.0, metavar="SECONDS",
                    help="start the measured window when the agent's engine reports ready (wait at most SECONDS)")
    ap.add_argument("--task", action="store_true", help="send the simulator's goal to the agent as a RunTask "
                    "action goal when the window starts (the agent decides nothing before its first task)")
    args = ap.parse_args(argv)
    if args.duration <= 0 or args.wait_engine < 0:
        ap.error("--duration must be > 0 and --wait-engine >= 0")
    listen(args.duration, args.out, live=args.live, wait_engine_s=args.wait_engine, task=args.task)


if __name__ == "__main__":
    main()
