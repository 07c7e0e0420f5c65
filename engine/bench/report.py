"""AAL report: per-engine metrics, physical floors, ratios against peers, targets, JSON/PNG/table.

Definitions (all from the same run):
- decision TTFT: decision start -> first answer token available (TokenSpeed: `Decision.ttft_s`,
  which includes the forced jump-forward prefix of the call; peers: first sampled token). For
  TokenSpeed the history was observed (prefilled) before the decision; peers process the new
  observations inside the decision (llama.cpp and transformers reuse their cached prefix).
- cold TTFT (llama.cpp): the same decision with its cache reset (the whole prompt processed).
- ITL: time between consecutive sampled tokens of the decisions; short-context ITL: the same in
  an unconstrained greedy generation after a ~40-token prompt; CPU/tok short: process CPU time
  per token there (all threads), which other processes on a shared machine do not inflate.
- turn: the 10-call agent turn end to end (observations + decisions), milliseconds.
- HTTP rows ("-http"): the same decisions as streaming chat completions through a server process,
  timed by the client (`peers.run_http`); they are compared with each other ("ours" of a "-http"
  peer is tokenspeed-int4-http).
- tokens/s: answer tokens (sampled + forced) per second of decision time.
- valid: schema-valid calls; right tool: valid calls of the tool the request asked for.
- floor: bytes of weights one decode step reads / measured memory bandwidth (ms per token).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

__all__ = ["percentile", "floor_ms", "summarize", "ratios", "targets", "agreement", "write_report", "print_table",
           "OURS", "HTTP", "TARGETS"]

OURS = "tokenspeed-int4"
HTTP = "-http"  # suffix of the rows measured through an HTTP server
# (name, our metric, peer, peer metric, bound): ours / peer <= bound, p50s from one run; a "-http"
# peer is compared with OURS + HTTP.
TARGETS = [
    ("ITL short context <= 1.0x llama.cpp", "itl_short_p50_ms", "llama.cpp", "itl_short_p50_ms", 1.0),
    ("warm decision TTFT <= 0.1x llama.cpp cold TTFT", "ttft_p50_ms", "llama.cpp", "cold_ttft_p50_ms", 0.1),
    ("warm decision TTFT <= 0.5x llama.cpp TTFT with prefix reuse", "ttft_p50_ms", "llama.cpp", "ttft_p50_ms", 0.5),
    ("10-call turn <= 0.5x llama.cpp", "turn_ms", "llama.cpp", "turn_ms", 0.5),
    ("HTTP 10-call turn <= 0.5x llama.cpp HTTP", "turn_ms", "llama.cpp-http", "turn_ms", 0.5),
]


def _ours(peer: str, ours: str = OURS) -> str:
    """Our engine to compare `peer` with: the HTTP row for an HTTP peer."""
    return ours + HTTP if peer.endswith(HTTP) and not peer.startswith(ours) else ours


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of `values`; None when empty."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    return vals[min(len(vals) - 1, max(0, math.ceil(q / 100 * len(vals)) - 1))]


def floor_ms(weight_bytes: int | None, bandwidth_gbs: float) -> float | None:
    """The memory-bandwidth floor of one decode step, ms: `weight_bytes` (what the step reads of its
    weights) / `bandwidth_gbs` (GB/s, `aal.measure_bandwidth`); None without a byte count."""
    return weight_bytes / (bandwidth_gbs * 1e9) * 1e3 if weight_bytes else None


def summarize(run: dict, bandwidth_gbs: float) -> dict:
    """Metrics of one engine's OUT.json record (see `peers.Recorder`); times in ms, memory in MiB."""
    turns = run["turns"]
    itl = [x for t in turns for x in t["itl_ms"]]
    decide_s = sum(t["decide_ms"] for t in turns) / 1e3
    out_tokens = sum(t["output_tokens"] for t in turns)
    cold = [c["ttft_ms"] for c in run.get("cold_ttft_ms", [])]
    floor = floor_ms(run.get("weight_bytes"), bandwidth_gbs)
    decided = sum(t.get("decided_tokens", 0) for t in turns)  # TokenSpeed only
    return {
        "engine": run["engine"], "config": run["config"], "threads": run["threads"],
        "calls": len(turns), "valid_calls": sum(bool(t["valid"]) for t in turns),
        "expected_tool_calls": sum(bool(t["valid"] and (t["tool_call"] or {}).get("name") == t.get("expect"))
                                   for t in turns),
        "ttft_p50_ms": percentile([t["ttft_ms"] for t in turns], 50),
        "ttft_p90_ms": percentile([t["ttft_ms"] for t in turns], 90),
        "cold_ttft_p50_ms": percentile(cold, 50),
        "itl_p50_ms": percentile(itl, 50), "itl_p90_ms": percentile(itl, 90),
        "itl_short_p50_ms": percentile(run.get("short_itl_ms", []), 50),
        "cpu_ms_per_token_short": run.get("short_cpu_ms_per_token"),
        "floor_ms": floor,
        "turn_ms": sum(t["turn_ms"] for t in turns),
        "tokens_per_s": out_tokens / decide_s if decide_s > 0 else None,
        "peak_rss_mb": run.get("peak_rss_mb"),
        "forwards_per_call": statistics.mean(fw) if (fw := [t["forwards"] for t in turns
                                                             if t["forwards"] is not None]) else None,
        "jump_forward_tokens": sum(t["forced_tokens"] for t in turns),
        "output_tokens": out_tokens,
        "context_tokens_last": turns[-1]["context_tokens"] if turns else None,
        "spec_acceptance": run.get("spec_acceptance"),
        # Speculation on tool calls: decided (not grammar-forced) tokens emitted per target forward
        # (EAGLE's acceptance length: accepted proposals + the target's own token), and the
        # proposals per source.
        "decided_tokens": decided,
        "decided_per_forward": decided / max(sum(t["forwards"] for t in turns), 1) if decided else None,
        "spec_sources": _sources(turns),
        "weight_mb": run["weight_bytes"] / 2**20 if run.get("weight_bytes") else None,
        "load_s": run.get("load_s"),
    }


def _sources(turns: list[dict]) -> dict[str, list[int]]:
    """{source: [proposed, accepted]} summed over the turns' draft_sources."""
    out: dict[str, list[int]] = {}
    for t in turns:
        for src, (proposed, accepted) in t.get("draft_sources", {}).items():
            acc = out.setdefault(src, [0, 0])
            acc[0] += proposed
            acc[1] += accepted
    return out


def ratios(summaries: dict[str, dict], ours: str = OURS) -> dict[str, dict]:
    """ours / peer for TTFT, ITL, short ITL and turn time, per peer (None where a side is missing);
    "ours" names our engine of the pair (see `_ours`)."""
    keys = ["ttft_p50_ms", "itl_p50_ms", "itl_short_p50_ms", "cpu_ms_per_token_short", "turn_ms"]
    out = {}
    for name, s in summaries.items():
        mine = summaries.get(_ours(name, ours))
        if name == _ours(name, ours) or mine is None:
            continue
        out[name] = {"ours": _ours(name, ours), **{k: (mine[k] / s[k] if mine.get(k) and s.get(k) else None)
                                                    for k in keys}}
        if s.get("cold_ttft_p50_ms") and mine.get("ttft_p50_ms"):
            out[name]["ttft_vs_cold"] = mine["ttft_p50_ms"] / s["cold_ttft_p50_ms"]
    return out


def targets(summaries: dict[str, dict], ours: str = OURS) -> list[dict]:
    """The issue's targets as [{"target", "ratio", "met"}] (ratio None when a side is missing)."""
    res = []
    for name, k_ours, peer, k_peer, bound in TARGETS:
        a, b = summaries.get(_ours(peer, ours), {}).get(k_ours), summaries.get(peer, {}).get(k_peer)
        r = a / b if a and b else None
        res.append({"target": name, "ratio": r, "bound": bound, "met": r is not None and r <= bound})
    return res


def agreement(runs: dict[str, dict], a: str = OURS, b: str = "tokenspeed-fp32") -> dict | None:
    """Share of decisions where two engines produced the same tool call (quality guard)."""
    if a not in runs or b not in runs:
        return None
    pairs = list(zip(runs[a]["turns"], runs[b]["turns"]))
    same = sum(x["tool_call"] == y["tool_call"] for x, y in pairs)
    return {"engines": [a, b], "same_calls": same, "calls": len(pairs), "rate": same / len(pairs) if pairs else None,
            "valid": {a: sum(bool(x["valid"]) for x, _ in pairs), b: sum(bool(y["valid"]) for _, y in pairs)}}


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write report.json and aal.png (matplotlib Agg) into out_dir; returns both paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(report, indent=1))
    s = report["summary"]
    names = list(s)
    panels = [("decision TTFT p50 (ms)", "ttft_p50_ms", None), ("ITL p50 (ms)", "itl_p50_ms", "floor_ms"),
              ("ITL short context p50 (ms)", "itl_short_p50_ms", "floor_ms"), ("10-call turn (s)", "turn_ms", None)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4))
    for ax, (title, key, floor_key) in zip(axes, panels):
        vals = [(s[n].get(key) or 0) / (1e3 if key == "turn_ms" else 1) for n in names]
        bars = ax.bar(range(len(names)), vals, color=["#1f77b4" if n.startswith("tokenspeed") else "#999999" for n in names])
        if floor_key:
            for i, n in enumerate(names):
                if s[n].get(floor_key):
                    ax.hlines(s[n][floor_key], i - 0.4, i + 0.4, colors="red", linestyles="dashed")
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_yscale("log" if key in ("ttft_p50_ms", "turn_ms") else "linear")
    fig.suptitle(f"Agent Action Latency - {report['machine']['threads']} threads, "
                 f"{report['machine']['bandwidth_gbs']:.1f} GB/s (red: weight-read floor)", fontsize=10)
    fig.tight_layout()
    png_path = out_dir / "aal.png"
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def print_table(report: dict) -> None:
    """Print the per-engine table, the ratio table and the targets with rich."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    m = report["machine"]
    t = Table(title=f"AAL: {report['workload']['calls']} calls, context to {report['workload']['context_tokens_last']} "
                    f"tokens, {m['threads']} threads, bandwidth {m['bandwidth_gbs']:.1f} GB/s, CPU kernels "
                    f"{m.get('cpu_kernels', '?')}")
    cols = [("engine", "engine", 0), ("TTFT p50", "ttft_p50_ms", 1), ("TTFT p90", "ttft_p90_ms", 1),
            ("cold TTFT", "cold_ttft_p50_ms", 0), ("ITL p50", "itl_p50_ms", 2), ("ITL p90", "itl_p90_ms", 2),
            ("ITL short", "itl_short_p50_ms", 2), ("CPU/tok short", "cpu_ms_per_token_short", 2),
            ("floor/tok", "floor_ms", 2), ("turn ms", "turn_ms", 0),
            ("tok/s", "tokens_per_s", 1), ("RSS MiB", "peak_rss_mb", 0), ("fwd/call", "forwards_per_call", 1),
            ("jump-fwd", "jump_forward_tokens", 0), ("spec acc", "spec_acceptance", 2), ("valid", "valid_calls", 0),
            ("right tool", "expected_tool_calls", 0)]
    for label, _, _ in cols:
        t.add_column(label, justify="left" if label == "engine" else "right")
    for s in report["summary"].values():
        t.add_row(*[_fmt(s.get(k), d) if k != "engine" else s[k] for _, k, d in cols])
    console.print(t)
    if report.get("weights"):
        console.print("weights: " + ", ".join(f"{name} {w}" for name, w in report["weights"].items()))
    r = Table(title=f"ratios ours / peer (lower is better; ours: {OURS}, {OURS}{HTTP} for HTTP peers)")
    for label in ("ours", "peer", "TTFT", "TTFT vs cold", "ITL", "ITL short", "CPU/tok short", "turn"):
        r.add_column(label, justify="right")
    for peer, x in report["ratios"].items():
        r.add_row(x.get("ours", OURS), peer, *[_fmt(x.get(k), 3) for k in ("ttft_p50_ms", "ttft_vs_cold", "itl_p50_ms", "itl_short_p50_ms",
                                                      "cpu_ms_per_token_short", "turn_ms")])
    console.print(r)
    for tg in report["targets"]:
        mark = "MET" if tg["met"] else ("n/a" if tg["ratio"] is None else "MISSED")
        console.print(f"  {mark}: {tg['target']} (ratio {_fmt(tg['ratio'], 3)})", markup=False)
    if report.get("agreement"):
        a = report["agreement"]
        console.print(f"  quality guard: {a['engines'][0]} vs {a['engines'][1]} greedy calls agree on "
                      f"{a['same_calls']}/{a['calls']} decisions; valid {a['valid']}", markup=False)
    ours, plain = report["summary"].get(OURS), report["summary"].get(OURS + "-plain")
    if ours and ours.get("decided_tokens"):
        src = ", ".join(f"{k} {a}/{p}" for k, (p, a) in sorted(ours["spec_sources"].items()))
        line = (f"  speculation ({OURS}): {ours['decided_tokens']} decided + {ours['jump_forward_tokens']} "
                f"grammar-forced tokens; proposals accepted {_fmt(ours['spec_acceptance'], 3)} ({src}); decided tokens per target "
                f"forward {_fmt(ours['decided_per_forward'], 2)}")
        if plain and plain.get("turn_ms"):
            line += (f"; speed-up vs no speculation (plain / speculative time, > 1: faster): turn "
                     f"{_fmt(plain['turn_ms'] / ours['turn_ms'], 3)}, ITL p50 "
                     f"{_fmt(plain['itl_p50_ms'] / ours['itl_p50_ms'], 3)}")
        console.print(line, markup=False)
    for note in report.get("notes", []):
        console.print(f"  note: {note}", markup=False)
