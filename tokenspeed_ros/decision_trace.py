"""The per-stage trace of a decision (no ROS here): where the time from a sensor reading to the
published command goes.

A trace joins what the node saw (the stamp of the reading the decision answers, when its
message arrived and when perception was done with it) with what the engine thread did
(`engine_worker.DecisionTrace`: queued, prefill start/end, decide start, first token, end) and
the command's publish time. `stages_ms` turns those times into consecutive stages; the robot's
"applied" stamp, the last stage, is the robot's to report (the latency harness adds it).
All times are wall-clock seconds on one host.
"""
from __future__ import annotations

from collections import deque

import numpy as np

KEPT = 1000     # decisions kept for the percentiles

# stage name -> (from, to): consecutive times of a trace
STAGES = {
    "sensor_to_received": ("capture", "received"),
    "perception": ("received", "perceived"),
    "perceived_to_queued": ("perceived", "queued"),
    "queue_wait": ("queued", "prefill_start"),
    "prefill": ("prefill_start", "prefill_end"),
    "prefill_to_decide": ("prefill_end", "decide_start"),
    "ttft": ("decide_start", "first_token"),
    "decode": ("first_token", "end"),
    "end_to_published": ("end", "published"),
}


def stages_ms(times: dict) -> dict[str, float | None]:
    """{stage: milliseconds} from a trace's absolute times (seconds); None where either end is
    missing (0 or absent), e.g. perception for a decision answering a joint-state reading."""
    out = {}
    for name, (a, b) in STAGES.items():
        ta, tb = times.get(a) or 0.0, times.get(b) or 0.0
        out[name] = (tb - ta) * 1e3 if ta and tb else None
    return out


def trace_record(decision_id: int, tool: str, status: str, node: dict, engine: dict | None, published: float) -> dict:
    """One decision's trace as published on the trace topic (JSON): the id, the tool the model
    called ("" for none), the engine's status ("ok", "deadline_missed", "task_done", ...), the
    absolute times (`node`: capture, received, perceived; `engine`: `DecisionTrace.as_dict()` or
    None when the engine did not take it; `published`: the command's stamp, 0.0 for a result
    dropped as late), tokens, whether it was decided ahead, and `stages_ms`."""
    times = {**node, **(engine or {}), "published": published}
    return {"decision_id": decision_id, "tool": tool, "status": status, "times": times,
            "tokens_in": times.get("tokens_in", 0), "prefill_tokens": times.get("prefill_tokens", 0),
            "context_tokens": times.get("context_tokens", 0), "ahead": times.get("ahead", ""),
            "stages_ms": stages_ms(times)}


class TraceStats:
    """Rolling p50 per stage and of the tokens per decision, for /diagnostics."""

    def __init__(self):
        self._stages: dict[str, deque] = {s: deque(maxlen=KEPT) for s in STAGES}
        self._tokens: deque = deque(maxlen=KEPT)

    def add(self, record: dict) -> None:
        for s, v in record["stages_ms"].items():
            if v is not None:
                self._stages[s].append(v)
        if record["times"].get("queued"):
            self._tokens.append(record["tokens_in"])

    def key_values(self) -> list[tuple[str, str]]:
        """[(key, value)]: trace_<stage>_p50_ms and tokens_per_decision_p50 where there is data."""
        out = [(f"trace_{s}_p50_ms", f"{np.median(v):.1f}") for s, v in self._stages.items() if v]
        if self._tokens:
            out.append(("tokens_per_decision_p50", f"{np.median(self._tokens):.0f}"))
        return out
