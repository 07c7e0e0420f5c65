"""`tokenspeed_soak`: the cobot loop and the market replay together for N minutes, then a report.

Real processes, as a user would start them: `tokenspeed_launch cobot_sim` (simulator + agent),
`tokenspeed_launch market` (the market bridge and its agent, ZeroMQ over ipc://) and
`tokenspeed_market_replay` (the recorded Bitstamp order flow, restarted when the ~30-minute
capture ends). This process listens over DDS with the latency harness
(`tokenspeed_sim.harness.LatencyHarness`) and over ZeroMQ to the bridge's status, and samples
every process's resident memory (psutil).

The cobot workload never ends (`TaskCycle`): the simulator's task goes to the agent as a RunTask
action goal (with `--task-timeout`); when it ends, done or failed, the simulator's `sim/reset`
service lays out the next task (new cube and target positions, the next target cube) and its goal
is sent. The report counts the tasks started and finished per outcome, and per loop the longest
time without a decision (`longest_silence_s`, an invariant: at most `SILENCE_BOUND_S`).

Every stream carries sequence numbers, so a lost message shows as a gap: each decision loop's
`decision_id` (ActionCommand and DeadlineStatus; the monitor publishes exactly one command per
decision) and the replay's book `sequence_number` (the bridge counts `seq_gap`); the feed's
messages sent (the replays' own counts) are compared with those the bridge received, and the
cobot's commands with the simulator's feedback.

Per loop ("cobot", "market") the report holds the decisions and their outcomes: a model call on
time ("met"), a fallback within the monitor's bound (`FALLBACK_BOUND_S`), or a fallback later
than that ("late", as measured by the monitor itself, /diagnostics). Outputs in `--out`:
soak.json (the report), soak.png (RSS per process, decision latency and outcomes over time),
latency.png (the cobot harness's plot) and the launches' logs. The measured window starts when
both engines are ready. Exit status 0 when the invariants hold: every decision ended in a call or
a fallback within the bound, no loop went silent, nothing was lost, no process crashed (exited
during the run or logged a traceback) and both launches stopped cleanly.

Example: `tokenspeed_soak --minutes 60 --out out/soak`
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import rclpy
import zmq
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.action import ActionClient
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_srvs.srv import Trigger
from tokenspeed_msgs.action import RunTask
from tokenspeed_msgs.msg import ActionCommand, DeadlineStatus

from tokenspeed_ros.deadline_monitor import FALLBACK_BOUND_S
from tokenspeed_sim import ros_spin
from tokenspeed_sim.demo import launch_command, wait_launch
from tokenspeed_sim.harness import TASK_RESEND_S, LatencyHarness, percentiles, write_plot

SPIN_CHUNK_S = 0.5        # the listener spins this long between ZeroMQ drains and process checks
STOP_GRACE_S = 15.0       # the launchers' wait after SIGINT: an engine mid-forward on a loaded CPU ends late
LOOPS = {"cobot": ("agent", "/tokenspeed_agent"), "market": ("market", "/tokenspeed_market_bridge")}
TASK_TIMEOUT_S = 120.0    # a cobot task not done by then fails, and the next one starts
SILENCE_BOUND_S = 30.0    # the longest a loop may go without a decision: a few decision periods (cobot: 1 s,
                          # skipped while the arm executes a call; market: the 10 s timer trigger) plus a reset


@dataclass
class LoopTally:
    """What one decision loop published, as received over DDS. Times are wall-clock seconds."""

    topic_prefix: str                    # "agent" -> agent/action, agent/deadline_status
    node: str                            # the node's fully qualified name in /diagnostics ("<node>: decisions")
    outcomes: dict[int, tuple[float, bool, bool, str, float]] = field(default_factory=dict)
    # decision id -> (received, met, fallback_used, reason, latency_s) of its first DeadlineStatus
    commands: dict[int, str] = field(default_factory=dict)     # decision id -> source
    duplicate_commands: int = 0
    monitor: dict[str, str] = field(default_factory=dict)      # latest "<node>: decisions" values

    def attach(self, node) -> None:
        """Subscribe `node` to this loop's command and status topics and /diagnostics."""
        qos = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(ActionCommand, f"{self.topic_prefix}/action", self._on_command, qos)
        node.create_subscription(DeadlineStatus, f"{self.topic_prefix}/deadline_status", self._on_status, qos)
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 10)

    def _on_command(self, msg: ActionCommand) -> None:
        if msg.decision_id in self.commands:
            self.duplicate_commands += 1
        self.commands[msg.decision_id] = msg.source

    def _on_status(self, msg: DeadlineStatus) -> None:
        if msg.decision_id not in self.outcomes:          # "late_result_dropped" repeats an id
            self.outcomes[msg.decision_id] = (time.time(), msg.met, msg.fallback_used, msg.reason, msg.latency_s)

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        for st in msg.status:
            if st.name == f"{self.node}: decisions":
                self.monitor.update({kv.key: kv.value for kv in st.values})

    def report(self, window_start: float) -> dict:
        """Outcomes of the decisions received from `window_start` on, lost messages over the whole
        run (gaps in the decision ids 1..max), latency (s) of the model's calls and its slope (ms/h)."""
        window = {i: o for i, o in self.outcomes.items() if o[0] >= window_start}
        met = sum(o[1] for o in window.values())
        fallback = sum(o[2] for o in window.values())
        late = int(self.monitor.get("fallback_late", 0))
        last_id = max([*self.outcomes, *self.commands], default=0)
        model = sorted((o[0], o[4]) for o in window.values() if o[1])
        times = [window_start, *sorted(o[0] for o in window.values()), time.time()]
        return {
            "decisions": len(window), "met": met, "fallback": fallback,
            "longest_silence_s": max(b - a for a, b in zip(times, times[1:])),   # no decision for this long
            "fallback_within_bound": fallback - late, "late": late,
            "neither": len(window) - met - fallback,
            "reasons": dict(Counter(o[3] for o in window.values())),
            "decisions_before_window": len(self.outcomes) - len(window),
            # the monitor's own measure of its missed deadlines' fallbacks (p50/p90/p99/max, ms after the deadline)
            "fallback_lateness_ms": {k[len("fallback_lateness_"):-len("_ms")]: float(v) for k, v in self.monitor.items()
                                     if k.startswith("fallback_lateness_")},
            "commands_published": last_id, "commands_received": len(self.commands),
            "commands_lost": last_id - len(self.commands), "statuses_lost": last_id - len(self.outcomes),
            "duplicate_commands": self.duplicate_commands,
            "model_latency_s": percentiles([v for _, v in model]),
            "model_latency_slope_ms_per_h": slope_per_hour(model, scale=1e3),
        }


def slope_per_hour(points: list[tuple[float, float]], scale: float = 1.0) -> float | None:
    """Least-squares slope of (time s, value) points, in value*scale per hour; None under 3 points."""
    if len(points) < 3:
        return None
    t, v = np.asarray(points, dtype=np.float64).T
    if np.ptp(t) <= 0:
        return None
    return float(np.polyfit(t / 3600.0, v * scale, 1)[0])


class TaskCycle:
    """The cobot's endless workload over the real interfaces: the simulator's current task (its
    `goal` topic, then each `sim/reset` answer) goes to the agent as a RunTask goal with
    `timeout_s`; when the goal's result comes (done, failed or cancelled), `sim/reset` lays out
    the next task. Call `step()` between spins; callbacks advance it."""

    def __init__(self, node, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._client = ActionClient(node, RunTask, "run_task")
        self._reset = node.create_client(Trigger, "sim/reset")
        self.goal = ""                 # the next task's text ("" until the simulator's goal is known)
        self.state = "idle"            # idle -> sending -> running -> reset_due -> resetting -> idle
        self.started = 0
        self.rejected = 0              # goals the agent refused once active, or resets the simulator refused
        self.rejected_before_active = 0  # goals refused before the first was accepted (the agent not yet active)
        self._resend_at = 0.0          # wall time before which a refused first goal is not sent again
        self.outcomes: Counter = Counter()
        self.results: list[tuple[str, int, float]] = []   # (outcome, decisions, duration s) per finished task
        self.last_change = time.time()                    # wall time of the last task start or result

    def step(self, sim_goal: str) -> None:
        """Send the next goal or the reset when due. sim_goal: the simulator's latest goal text."""
        self.goal = self.goal or sim_goal
        if (self.state == "idle" and self.goal and self._client.server_is_ready()
                and time.time() >= self._resend_at):
            self.state = "sending"
            sent = self._client.send_goal_async(RunTask.Goal(task=self.goal, timeout_s=self.timeout_s))
            sent.add_done_callback(self._on_accepted)
        elif self.state == "reset_due" and self._reset.service_is_ready():
            self.state = "resetting"
            self._reset.call_async(Trigger.Request()).add_done_callback(self._on_reset)

    def _on_accepted(self, future) -> None:
        handle = future.result()
        if not handle.accepted:
            # the action server exists once the model is loaded, but the agent accepts goals only once
            # it is active, a moment later (as the latency harness does, the first goal is sent again)
            if self.started:
                self.rejected += 1
            else:
                self.rejected_before_active += 1
                self._resend_at = time.time() + TASK_RESEND_S
            self.state = "idle"
            return
        self.started += 1
        self.state, self.last_change = "running", time.time()
        handle.get_result_async().add_done_callback(self._on_result)

    def _on_result(self, future) -> None:
        r = future.result().result
        self.outcomes[r.outcome] += 1
        self.results.append((r.outcome, r.decisions, r.duration_s))
        self.state, self.last_change = "reset_due", time.time()

    def _on_reset(self, future) -> None:
        answer = future.result()
        if answer.success:
            self.goal = answer.message
        else:
            self.rejected += 1
        self.state = "idle" if answer.success else "reset_due"

    def report(self) -> dict:
        """Tasks started, finished per outcome, their decisions and durations (s)."""
        return {"started": self.started, "finished": sum(self.outcomes.values()), "outcomes": dict(self.outcomes),
                "rejected": self.rejected, "rejected_before_active": self.rejected_before_active,
                "timeout_s": self.timeout_s, "state_at_end": self.state,
                "decisions_per_task": percentiles([float(d) for _, d, _ in self.results]),
                "duration_s": percentiles([t for _, _, t in self.results])}


class ProcessSampler:
    """RSS (MB) of the launches' processes, the replays and this process over time."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, str, float]] = []    # (wall time, label, RSS MB)

    @staticmethod
    def label(proc: psutil.Process, root_label: str) -> str:
        """The console entry point `proc` runs (tokenspeed_agent, ...), else "<root_label>/<name>"."""
        try:
            args = proc.cmdline()
            return next((os.path.basename(a) for a in args[:2] if os.path.basename(a).startswith("tokenspeed_")),
                        f"{root_label}/{proc.name()}")
        except psutil.Error:
            return f"{root_label}/?"

    def sample(self, roots: dict[str, subprocess.Popen]) -> None:
        """One RSS sample of this process and every live process under `roots` ({label: process});
        a child is labelled by the console entry point it runs, else "<root label>/<its name>"."""
        now = time.time()
        procs = [("tokenspeed_soak", psutil.Process())]
        for root_label, r in roots.items():
            try:
                root = psutil.Process(r.pid)
                procs += [(root_label, root)] + [(self.label(c, root_label), c) for c in root.children(recursive=True)]
            except psutil.Error:
                pass
        seen: Counter = Counter()
        for label, p in procs:
            seen[label] += 1
            try:
                self.samples.append((now, label if seen[label] == 1 else f"{label}#{seen[label]}",
                                     p.memory_info().rss / 2**20))
            except psutil.Error:
                pass

    def report(self, window_start: float) -> dict:
        """Per label: first, last and max RSS (MB) and the slope (MB/h) over the window."""
        out = {}
        for label in sorted({s[1] for s in self.samples}):
            pts = [(t, mb) for t, lab, mb in self.samples if lab == label and t >= window_start]
            if pts:
                out[label] = {"samples": len(pts), "first_mb": pts[0][1], "last_mb": pts[-1][1],
                              "max_mb": max(mb for _, mb in pts), "slope_mb_per_h": slope_per_hour(pts)}
        return out


class MarketStatus:
    """The bridge's ZeroMQ status (JSON, topic "status") from its decision socket, and the
    decisions received there."""

    def __init__(self, endpoint: str) -> None:
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self.latest: dict = {}
        self.decisions_received = 0

    def drain(self) -> None:
        while self._sub.poll(0):
            topic, _, body = self._sub.recv().partition(b" ")
            if topic == b"status":
                self.latest = json.loads(body)
            else:
                self.decisions_received += 1

    def close(self) -> None:
        self._sub.close(linger=0)


class Replay:
    """`tokenspeed_market_replay` runs back to back (the capture lasts ~30 min), feeding the bridge
    until a wall-clock end; sums what each run reports it sent."""

    def __init__(self, endpoint: str, log) -> None:
        self.endpoint, self.log = endpoint, log
        self.proc: subprocess.Popen | None = None
        self.runs: list[dict] = []
        self.failed = 0

    def step(self, end: float) -> None:
        """Collect a finished run; start the next one while more than 5 s remain before `end`."""
        if self.proc is not None and self.proc.poll() is not None:
            out = self.proc.stdout.read().strip().splitlines()
            if self.proc.returncode == 0 and out:
                self.runs.append(json.loads(out[-1]))
            else:
                self.failed += 1
            self.proc = None
        remaining = end - time.time()
        if self.proc is None and remaining > 5.0:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tokenspeed_sim.market_replay", "--endpoint", self.endpoint,
                 "--duration", f"{remaining:.1f}", "--wait-subscriber", "60"],
                stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)

    def finish(self, timeout_s: float) -> None:
        """Wait up to timeout_s for the running replay to end by itself (then it is counted)."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.step(0.0)

    @property
    def sent(self) -> int:
        return sum(r.get("sent", 0) for r in self.runs)


def invariants(report: dict) -> dict[str, bool]:
    """The soak's promises, each True when it held."""
    loops = [report["cobot"], report["market"]]
    return {
        "every_decision_a_call_or_fallback": all(lp["decisions"] > 0 and lp["neither"] == 0 for lp in loops),
        "every_fallback_within_bound": all(lp["late"] == 0 for lp in loops),
        "no_silent_loop": all(lp["longest_silence_s"] <= SILENCE_BOUND_S for lp in loops),
        "no_lost_messages": all(lp["commands_lost"] == 0 and lp["statuses_lost"] == 0 for lp in loops)
        and report["feed"]["lost"] == 0 and report["feed"]["seq_gap"] == 0
        and report["cobot"]["commands_without_sim_feedback"] == 0,
        "no_crash": report["crashes"] == 0,
        "clean_stop": all(rc == 0 for rc in report["launch_exit_status"].values()),
    }


def write_soak_plot(report: dict, tallies: dict[str, LoopTally], sampler: ProcessSampler, path: Path) -> None:
    """PNG: RSS per process over time (top), model-call latency and fallbacks over time (bottom)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = report["started"]
    fig, (ax_m, ax_l) = plt.subplots(2, 1, figsize=(12, 8), sharex=True)
    for label in sorted({s[1] for s in sampler.samples}):
        pts = [((t - t0) / 60, mb) for t, lab, mb in sampler.samples if lab == label]
        ax_m.plot(*zip(*pts), label=f"{label} ({report['rss'].get(label, {}).get('slope_mb_per_h') or 0:+.1f} MB/h)")
    ax_m.set_ylabel("RSS (MB)")
    ax_m.set_title("resident memory per process")
    ax_m.legend(fontsize=7)
    ax_m.grid(alpha=0.3)
    for color, (name, tally) in enumerate(tallies.items()):
        model = [((o[0] - t0) / 60, o[4] * 1e3) for o in tally.outcomes.values() if o[1]]
        fallback = [((o[0] - t0) / 60, o[4] * 1e3) for o in tally.outcomes.values() if o[2]]
        lp = report[name]
        if model:
            ax_l.plot(*zip(*model), "o", markersize=2, color=f"C{color}",
                      label=f"{name}: {lp['met']} calls on time")
        if fallback:
            ax_l.plot(*zip(*fallback), "x", markersize=4, color=f"C{color}",
                      label=f"{name}: {lp['fallback_within_bound']} fallbacks within bound, {lp['late']} late")
    ax_l.axvline((report["window_start"] - t0) / 60, color="grey", linestyle="--", linewidth=0.8)
    ax_l.set_xlabel("minutes since start (dashed: both engines ready)")
    ax_l.set_ylabel("observation -> outcome (ms)")
    ax_l.set_title("decisions")
    ax_l.legend(fontsize=7)
    ax_l.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(minutes: float, out_dir: Path, model: str = "", ready_timeout_s: float = 600.0,
        sample_s: float = 10.0, task_timeout_s: float = TASK_TIMEOUT_S) -> dict:
    """Run the soak; returns the report (also written to out_dir/soak.json with the plots).

    model: the model of both agents ("" = each node's parameter file: the embedded SmolLM2-135M).
    task_timeout_s: each cobot task's RunTask timeout_s (seconds).
    Raises OSError when a process cannot be started. rclpy must not be initialised yet.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    ipc = tempfile.TemporaryDirectory(prefix="tokenspeed-soak-")
    feed_ep, decision_ep = f"ipc://{ipc.name}/feed", f"ipc://{ipc.name}/decisions"
    total_s = ready_timeout_s + minutes * 60 + 120
    models = [f"tokenspeed_agent.model={model}"] if model else []
    market_set = [f"tokenspeed_market_bridge.feed_endpoint={feed_ep}",
                  f"tokenspeed_market_bridge.decision_endpoint={decision_ep}"]
    market_set += [f"tokenspeed_market_bridge.model={model}"] if model else []
    ros_spin.init()
    harness = LatencyHarness()
    tallies = {name: LoopTally(prefix, node) for name, (prefix, node) in LOOPS.items()}
    for t in tallies.values():
        t.attach(harness)
    spinner = ros_spin.Spinner(harness)       # one executor throughout: TaskCycle's futures resolve across chunks
    tasks = TaskCycle(harness, task_timeout_s)
    market = MarketStatus(decision_ep)
    sampler = ProcessSampler()
    logs = {name: open(out_dir / f"{name}.log", "w") for name in ("cobot", "market", "replay")}
    grace = ["--grace", f"{STOP_GRACE_S:g}"]
    launches = {
        "cobot": subprocess.Popen(launch_command(total_s, models) + grace,
                                  stdout=logs["cobot"], stderr=subprocess.STDOUT, start_new_session=True),
        "market": subprocess.Popen(launch_command(total_s, market_set, launch="market", task_from_action=False) + grace,
                                   stdout=logs["market"], stderr=subprocess.STDOUT, start_new_session=True)}
    replay = Replay(feed_ep, logs["replay"])
    crashed: list[str] = []
    started = time.time()
    why = "duration"
    next_sample = 0.0

    def tick() -> bool:
        """Between spins: ZeroMQ, RSS samples, crashed launches; True to stop early."""
        nonlocal next_sample
        market.drain()
        if time.time() >= next_sample:
            sampler.sample({**{f"tokenspeed_launch {name}": p for name, p in launches.items()},
                            **({"tokenspeed_market_replay": replay.proc} if replay.proc else {})})
            next_sample = time.time() + sample_s
        for name, p in launches.items():
            if p.poll() is not None and name not in crashed:
                crashed.append(name)
        return bool(crashed)

    try:
        print(f"tokenspeed_soak: cobot + market loops, {minutes:g} min once both engines are ready "
              f"(logs in {out_dir})", flush=True)
        ready = lambda: harness.engine_ready_at is not None and market.latest.get("engine") == "ready"  # noqa: E731
        while why == "duration" and not ready() and time.time() - started < ready_timeout_s and not tick():
            why = spinner.spin(SPIN_CHUNK_S)
        window_start = harness.window_start = time.time()
        end = window_start + minutes * 60
        print(f"tokenspeed_soak: engines {'ready' if ready() else 'NOT ready'} after {window_start - started:.0f} s; "
              f"measuring until {time.strftime('%H:%M:%S', time.localtime(end))}", flush=True)
        while why == "duration" and time.time() < end and not tick():
            replay.step(end)
            tasks.step(harness.goal_text)
            why = spinner.spin(SPIN_CHUNK_S)
        replay.finish(30.0)
        settle_end = time.time() + 5.0        # the last decisions' outcomes, diagnostics, status
        while why == "duration" and time.time() < settle_end and not tick():
            why = spinner.spin(SPIN_CHUNK_S)
        report, cobot_harness = build_report(harness, tallies, sampler, market, replay, started, window_start,
                                             crashed)
        report["cobot"]["tasks"] = tasks.report()
        write_plot(cobot_harness, out_dir / "latency.png")
        report["stopped_by"] = why if why != "duration" else ("crash" if crashed else "end")
    finally:
        for p in launches.values():       # both deactivate and stop at once
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        # the launcher's own sequence: deactivate (<= 5 s), then SIGINT, SIGTERM, SIGKILL STOP_GRACE_S apart
        exits = {name: wait_launch(p, 10 + 3 * STOP_GRACE_S) for name, p in launches.items()}
        replay.finish(0.0)
        market.close()
        spinner.close()
        harness.destroy_node()
        rclpy.try_shutdown()
        for f in logs.values():
            f.close()
        ipc.cleanup()
    report["launch_exit_status"] = exits
    tracebacks = {name: (out_dir / f"{name}.log").read_text().count("Traceback") for name in logs}
    report["tracebacks"] = tracebacks
    report["crashes"] = len(crashed) + sum(tracebacks.values())
    report["invariants"] = invariants(report)
    write_soak_plot(report, tallies, sampler, out_dir / "soak.png")
    (out_dir / "soak.json").write_text(json.dumps(report, indent=2))
    return report


def build_report(harness: LatencyHarness, tallies: dict[str, LoopTally], sampler: ProcessSampler,
                 market: MarketStatus, replay: Replay, started: float, window_start: float,
                 crashed: list[str]) -> tuple[dict, dict]:
    """(the soak's report so far, see the module docstring; the cobot harness's report)."""
    cobot_harness = harness.report()
    cobot = tallies["cobot"].report(window_start)
    unanswered = [d for d in cobot_harness["per_decision"] if not d["outcome"]]   # no feedback from the robot
    cobot["commands_without_sim_feedback"] = sum(d["in_window"] for d in unanswered)
    cobot["commands_without_sim_feedback_before_window"] = [d["decision_id"] for d in unanswered if not d["in_window"]]
    cobot["sim_feedback"] = cobot_harness["feedback"]
    cobot["stages_s"] = cobot_harness["stages"]
    cobot["task"] = cobot_harness["task"]
    feed, bridge = market.latest.get("feed", {}), market.latest.get("bridge", {})
    received = int(bridge.get("messages", 0))
    report = {
        "started": started, "window_start": window_start, "window_s": time.time() - window_start,
        "engines_ready_after_s": window_start - started,
        "fallback_bound_s": FALLBACK_BOUND_S,
        "cobot": cobot,
        "market": {**tallies["market"].report(window_start),
                   "decisions_received_zmq": market.decisions_received},
        "feed": {"replay_runs": len(replay.runs), "replay_failures": replay.failed, "sent": replay.sent,
                 "received_by_bridge": received, "lost": max(0, replay.sent - received),
                 "seq_gap": int(feed.get("seq_gap", 0)), "resyncs": int(feed.get("resyncs", 0)),
                 "bad_records": {k: v for k, v in feed.items() if k not in ("book_snapshots", "book_deltas",
                                                                            "trades", "tickers") and v}},
        "rss": sampler.report(window_start),
        "crashed_during_run": crashed,
    }
    return report, cobot_harness


def main(argv: list[str] | None = None) -> int:
    """Console entry point `tokenspeed_soak`: 0 when the invariants held, 1 otherwise, 2 on bad arguments."""
    ap = argparse.ArgumentParser(prog="tokenspeed_soak", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--minutes", type=float, default=60.0, help="measured minutes once both engines are ready (default 60)")
    ap.add_argument("--out", type=Path, default=Path("out/soak"), help="folder for soak.json, soak.png, latency.png, logs")
    ap.add_argument("--model", default="", help='model of both agents: "" = embedded SmolLM2-135M, a path, or tiny-random')
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for both engines (default 600)")
    ap.add_argument("--sample", type=float, default=10.0, help="seconds between RSS samples (default 10)")
    ap.add_argument("--task-timeout", type=float, default=TASK_TIMEOUT_S,
                    help=f"seconds a cobot task may take before the next one starts (default {TASK_TIMEOUT_S:g})")
    args = ap.parse_args(argv)
    if not (args.minutes > 0 and args.ready_timeout > 0 and args.sample > 0 and args.task_timeout > 0):
        ap.error("--minutes, --ready-timeout, --sample and --task-timeout must be > 0")
    report = run(args.minutes, args.out, args.model, args.ready_timeout, args.sample, args.task_timeout)
    for name in ("cobot", "market"):
        lp = report[name]
        print(f"{name}: {lp['decisions']} decisions, {lp['met']} calls on time, {lp['fallback_within_bound']} "
              f"fallbacks within {FALLBACK_BOUND_S * 1e3:.0f} ms, {lp['late']} late, longest without a decision "
              f"{lp['longest_silence_s']:.0f} s (fallback lateness ms "
              f"{lp['fallback_lateness_ms']}); commands lost {lp['commands_lost']}; model latency slope "
              f"{lp['model_latency_slope_ms_per_h']} ms/h")
    tasks = report["cobot"]["tasks"]
    print(f"cobot tasks: {tasks['started']} started, {tasks['finished']} finished {tasks['outcomes']}, "
          f"the cycle {tasks['state_at_end']} at the end")
    feed = report["feed"]
    print(f"feed: {feed['sent']} sent, {feed['received_by_bridge']} received, {feed['seq_gap']} sequence gaps")
    for label, r in report["rss"].items():
        print(f"RSS {label}: {r['first_mb']:.0f} -> {r['last_mb']:.0f} MB, slope {r['slope_mb_per_h']} MB/h")
    print(f"invariants: {report['invariants']}; report {args.out / 'soak.json'}", flush=True)
    return 0 if all(report["invariants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
