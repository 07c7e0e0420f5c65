"""`tokenspeed bench auto`: does tool_choice="auto" call when a tool applies and answer in text
when none does, per tool-listing prompt (`tokenspeed.grammar.TOOL_PROMPTS`)?

Data: the held-in BFCL simple_python cases (id % 5 != 0; the held-out fifth is kept for draft
evaluation). "applies": the case's question with its own function. "none applies": the same
question with the function of another case (a different name and purpose). Under "auto" the
first answer token settles call or text (a call starts with "<"), so each case is one decision
with max_tokens=1: a prefill of the prompt and one step. Because a small model rarely puts a call
first, the probability of the call's first token at that step (unconstrained logits, one more
prefill) is reported too: a finer signal of which prompt pulls the model towards calling.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

__all__ = ["run_auto", "add_parser"]


def run_auto(styles: list[str], n: int, bfcl: Path | None = None, threads: int | None = None,
             quantize: str | None = "int4", model: str | None = None) -> dict:
    """Call/text rates of tool_choice "auto" per tool-listing prompt style.

    Args:
        styles: names from `tokenspeed.grammar.TOOL_PROMPTS`.
        n: held-in cases used (the first n by id order); each is decided twice per style.
        bfcl: BFCL folder (default `tokenspeed.bfcl.bfcl_dir()`).
        threads, quantize, model: as for `Engine.load`.
    Returns:
        {"cases": n, "model", "threads", "styles": {style: {"call_when_applies", "text_when_none"
        (fractions in [0, 1]), "balanced" (their mean), "p_call_applies", "p_call_none" (mean
        probability of the call's first token), "seconds"}}}.
    Raises:
        ToolSchemaError: an unknown style; FileNotFoundError: no BFCL data.
    """
    import torch

    from ..bfcl import load_bfcl
    from ..grammar import TOOL_PROMPTS, ToolSchemaError, format_tool_calls
    from ..engine import Engine

    unknown = [s for s in styles if s not in TOOL_PROMPTS]
    if unknown:
        raise ToolSchemaError(f"unknown tool prompt style(s) {unknown}; known: {sorted(TOOL_PROMPTS)}")
    cases = load_bfcl("train", bfcl)[:n]
    if len(cases) < 2:
        raise ValueError(f"need at least 2 BFCL cases, got {len(cases)}")
    engine = Engine.load(model, threads=threads, quantize=quantize)

    tok = engine.tokenizer
    call_start = tok.encode(format_tool_calls([{"name": "x", "arguments": {}}], engine.call_format))[0]

    def decide(case: dict, tools: list[dict], style: str) -> tuple[bool, float]:
        # (auto called, probability of the call's first token at the first step)
        session = engine.session(tools=tools, tool_prompt=style)
        session.observe(case["messages"])
        ids = session.tokens + session.pending + tok.encode(tok.assistant_prefix)
        with torch.inference_mode():
            logits = engine.model(torch.tensor(ids), torch.arange(len(ids)), engine.model.new_cache(len(ids)))
        p = float(torch.softmax(logits[-1].float(), -1)[call_start])
        return session.decide(tool_choice="auto", max_tokens=1).status != "text", p

    out = {"cases": len(cases), "model": engine.source, "threads": torch.get_num_threads(), "styles": {}}
    for style in styles:
        t0 = time.perf_counter()
        applies = [decide(c, c["tools"], style) for c in cases]
        # Another case's function: shift by half the set so neighbours (often similar) are not paired.
        others = [cases[(i + len(cases) // 2) % len(cases)]["tools"] for i in range(len(cases))]
        none = [decide(c, o, style) for c, o in zip(cases, others)]
        a = sum(called for called, _ in applies) / len(cases)
        b = sum(not called for called, _ in none) / len(cases)
        out["styles"][style] = {"call_when_applies": a, "text_when_none": b, "balanced": (a + b) / 2,
                                "p_call_applies": statistics.fmean(p for _, p in applies),
                                "p_call_none": statistics.fmean(p for _, p in none),
                                "seconds": time.perf_counter() - t0}
    return out


def _cmd(args) -> int:
    from ..grammar import ToolSchemaError

    try:
        report = run_auto(args.styles.split(","), args.cases, Path(args.bfcl) if args.bfcl else None,
                          args.threads, None if args.quantize == "none" else args.quantize, args.model)
    except (ToolSchemaError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"# {report['cases']} held-in BFCL cases, model {report['model']}, {report['threads']} threads")
    print(f"{'tool prompt':<12} {'call|applies':>12} {'text|none':>10} {'balanced':>9} {'p(call)|applies':>16} "
          f"{'p(call)|none':>13} {'s':>6}")
    for style, r in report["styles"].items():
        print(f"{style:<12} {r['call_when_applies']:>12.2f} {r['text_when_none']:>10.2f} {r['balanced']:>9.2f} "
              f"{r['p_call_applies']:>16.4f} {r['p_call_none']:>13.4f} {r['seconds']:>6.0f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `auto` on the `bench` subparsers."""
    from ..grammar import TOOL_PROMPTS

    p = sub.add_parser("auto", help="tool_choice=auto: call rate when a tool applies, text rate when none (BFCL)")
    p.add_argument("--styles", default=",".join(TOOL_PROMPTS),
                   help=f"comma-separated tool prompt styles (default: all of {','.join(TOOL_PROMPTS)})")
    p.add_argument("--cases", type=int, default=60, help="held-in BFCL cases (default 60)")
    p.add_argument("--bfcl", default=None, help="BFCL data folder (default: $TOKENSPEED_BFCL, then the copy shipped with tokenspeed)")
    p.add_argument("--model", default=None, help="a .gguf file or safetensors folder (default: embedded model)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--quantize", default="int4", choices=["auto", "gguf", "int4", "int8", "none"])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.set_defaults(func=_cmd)
    return p
