"""`tokenspeed bench auto`: does tool_choice="auto" call when a tool applies and answer in text
when none does, and does any answer under "required" run to max_tokens?

Data: the labelled set `tokenspeed.auto.LABELLED` (robot and market tools with questions where one
applies and where none does, held-in BFCL cases with their own function, and no-tool questions
with BFCL tools listed). Under "auto" the first answer token settles call or text, so each case is
decided with max_tokens=1 twice on one prefill: "before" with the plain rule (threshold off: the
masked argmax), "after" with the threshold (`--threshold`, else the model's calibration). The
first decision also gives p(call) (`Decision.p_call`); `--calibrate` chooses the threshold from
those of the held-in half (`tokenspeed.auto.calibrate`, `held_out`), stores it with the model's
cached files and reports "after" as that threshold's comparison on them (the comparison
`AutoRule` makes), on the held-out half apart. `--required` also
answers every case under tool_choice="required" (parallel calls allowed, max_tokens 256, the
server's default) and counts the answers that ran to max_tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from ..cli import positive_int
from ..grammar import DEFAULT_TOOL_PROMPT, TOOL_PROMPTS

__all__ = ["run_auto", "add_parser"]

REQUIRED_MAX_TOKENS = 256  # `tokenspeed serve`'s default max_tokens


def run_auto(threshold: float | None = None, calibrate: bool = False, required: bool = False,
             bfcl: Path | None = None, threads: int | None = None, quantize: str | None = "int4",
             model: str | None = None, limit: int | None = None, tool_prompt: str = DEFAULT_TOOL_PROMPT) -> dict:
    """Call rates of tool_choice "auto" before (plain rule) and after (threshold) on the labelled set.

    Args:
        threshold: the threshold "after" uses (None: the model's calibration).
        calibrate: choose the threshold on this run and store it (`tokenspeed.auto.store_threshold`).
        required: also count the answers under "required" that run to max_tokens.
        bfcl: BFCL folder (default `tokenspeed.bfcl.bfcl_dir()`).
        threads, quantize, model: as for `Engine.load`.
        limit: use the first `limit` cases of each label (None: all).
        tool_prompt: how the tools are listed (`tokenspeed.grammar.TOOL_PROMPTS`).
    Returns:
        {"model", "threads", "cases": {"call": n, "text": n}, "threshold", "calibrated" (bool),
        "before"/"after": {"call_when_applies", "call_when_none"} (fractions), "p_call_applies",
        "p_call_none" (medians), "held_in"/"held_out": "after" on the cases calibration holds in
        (chooses the threshold on) and leaves out (`tokenspeed.auto.held_out`), "by_source": {source: {"before", "after"} as above},
        "runaway": {"count", "cases", "ids", "longest": the most tokens an answer took} (with
        `required`), "seconds", "rows": per case {"id", "label", "source", "held_out", "p_call",
        "before", "after", "required_tokens" (with `required`)}}.
    Raises:
        ValueError: no threshold to compare against (no calibration and none given).
    """
    import torch

    from ..auto import calibrate as choose, held_out, labelled_cases, store_threshold
    from ..engine import Engine

    cases = labelled_cases(bfcl)
    if limit is not None:
        cases = [c for c in cases if c["label"] == "call"][:limit] + [c for c in cases if c["label"] == "text"][:limit]
    engine = Engine.load(model, threads=threads, quantize=quantize)
    threshold = threshold if threshold is not None else None if calibrate else engine.auto_threshold.get(tool_prompt)
    if threshold is None and not calibrate:
        raise ValueError(f"no auto threshold for this model and tool prompt {tool_prompt!r}: pass --threshold or "
                         "--calibrate")
    engine.auto_threshold = {}  # "before": the plain rule
    t0 = time.perf_counter()
    rows, runaway = [], []
    for case, left in zip(cases, held_out(cases)):
        session = engine.session(tools=case["tools"], tool_prompt=tool_prompt)
        session.observe(case["messages"])
        cp = session.checkpoint()
        d = session.decide(tool_choice="auto", max_tokens=1)
        row = {"id": case["id"], "label": case["label"], "source": case["source"], "held_out": left, "p_call": d.p_call,
               "before": d.status != "text"}
        if threshold is not None:
            session.rollback(cp)
            row["after"] = session.decide(tool_choice="auto", max_tokens=1, auto_threshold=threshold).status != "text"
        if required:
            session.rollback(cp)
            d = session.decide(tool_choice="required", parallel=True, max_tokens=REQUIRED_MAX_TOKENS)
            row["required_tokens"] = d.generated_tokens + d.forced_tokens
            if row["required_tokens"] >= REQUIRED_MAX_TOKENS:
                runaway.append(case["id"])
        rows.append(row)
    applies = [r for r in rows if r["label"] == "call"]
    none = [r for r in rows if r["label"] == "text"]
    if calibrate:
        threshold = choose([r["p_call"] for r in applies if not r["held_out"]],
                           [r["p_call"] for r in none if not r["held_out"]])
        for r in rows:
            r["after"] = r["p_call"] >= threshold

    def rates(subset: list[dict], key: str) -> dict:
        yes, no = [r for r in subset if r["label"] == "call"], [r for r in subset if r["label"] == "text"]
        return {"call_when_applies": sum(r[key] for r in yes) / max(len(yes), 1),
                "call_when_none": sum(r[key] for r in no) / max(len(no), 1)}

    out = {"model": engine.source, "threads": torch.get_num_threads(),
           "cases": {"call": len(applies), "text": len(none)}, "threshold": threshold, "calibrated": calibrate,
           "before": rates(rows, "before"), "after": rates(rows, "after"),
           "held_in": rates([r for r in rows if not r["held_out"]], "after"),
           "held_out": rates([r for r in rows if r["held_out"]], "after"),
           "p_call_applies": statistics.median(r["p_call"] for r in applies),
           "p_call_none": statistics.median(r["p_call"] for r in none),
           "by_source": {s: {k: rates([r for r in rows if r["source"] == s], k) for k in ("before", "after")}
                         for s in sorted({r["source"] for r in rows})},
           "seconds": time.perf_counter() - t0, "rows": rows}
    if required:
        out["runaway"] = {"count": len(runaway), "cases": len(rows), "ids": runaway,
                          "longest": max(r["required_tokens"] for r in rows)}
    if calibrate and engine.folder is not None:
        out["stored_in"] = str(store_threshold(engine.folder, tool_prompt, threshold, {
            "cases": out["cases"], "after": out["after"], "held_out": out["held_out"], "p_call_applies": out["p_call_applies"],
            "p_call_none": out["p_call_none"], "quantize": quantize}))
    return out


def _cmd(args) -> int:
    try:
        report = run_auto(args.threshold, args.calibrate, args.required, Path(args.bfcl) if args.bfcl else None,
                          args.threads, None if args.quantize == "none" else args.quantize, args.model, args.limit,
                          args.tool_prompt)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n = report["cases"]
    print(f"# labelled set: {n['call']} where a tool applies, {n['text']} where none does; model {report['model']}, "
          f"{report['threads']} threads; threshold {report['threshold']:.4f}"
          f"{' (calibrated now)' if report['calibrated'] else ''}; median p(call) {report['p_call_applies']:.4f} "
          f"(applies) / {report['p_call_none']:.4f} (none)")
    print(f"{'rule':<28} {'call|applies':>12} {'call|none':>10}")
    for key, name in (("before", "before (plain argmax)"), ("after", "after (p(call) >= threshold)")):
        r = report[key]
        print(f"{name:<28} {r['call_when_applies']:>12.2f} {r['call_when_none']:>10.2f}")
    for key in ("held_in", "held_out"):
        r = report[key]
        print(f"  after, {key.replace('_', '-'):<19} {r['call_when_applies']:>12.2f} {r['call_when_none']:>10.2f}")
    for source, r in report["by_source"].items():
        print(f"  {source:<26} {r['before']['call_when_applies']:.2f}/{r['before']['call_when_none']:.2f} -> "
              f"{r['after']['call_when_applies']:.2f}/{r['after']['call_when_none']:.2f}")
    if "runaway" in report:
        w = report["runaway"]
        print(f"required, max_tokens {REQUIRED_MAX_TOKENS}: {w['count']} of {w['cases']} answers ran to max_tokens "
              f"{w['ids']}; the longest took {w['longest']} tokens")
    if "stored_in" in report:
        print(f"threshold stored in {report['stored_in']}")
    print(f"{report['seconds']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `auto` on the `bench` subparsers."""
    p = sub.add_parser("auto", help="tool_choice=auto: call rate when a tool applies and when none does, "
                                    "before/after the p(call) threshold (labelled set); --calibrate sets it")
    p.add_argument("--threshold", type=float, default=None, help="threshold for 'after' (default: the model's calibration)")
    p.add_argument("--calibrate", action="store_true", help="choose the threshold on the labelled set and store it")
    p.add_argument("--required", action="store_true", help="also count answers under required that run to max_tokens")
    p.add_argument("--tool-prompt", default=DEFAULT_TOOL_PROMPT, choices=sorted(TOOL_PROMPTS),
                   help=f"how the tools are listed in the system prompt (default {DEFAULT_TOOL_PROMPT})")
    p.add_argument("--limit", type=int, default=None, help="first N cases of each label (default: all)")
    p.add_argument("--bfcl", default=None, help="BFCL data folder (default: $TOKENSPEED_BFCL, then the copy shipped with tokenspeed)")
    p.add_argument("--model", default=None, help="a .gguf file or safetensors folder (default: embedded model)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--quantize", default="int4", choices=["auto", "gguf", "int4", "int8", "none"])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.set_defaults(func=_cmd)
    return p
