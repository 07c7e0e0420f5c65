"""Benchmarks: `tokenspeed bench aal` (Agent Action Latency, against llama.cpp and transformers)
and `tokenspeed bench gpu` (the same decode path on CUDA against the HBM floor).

    tokenspeed bench aal --quick            # small workload, a minute or two on 2 cores
    tokenspeed bench aal --threads 2        # the full 10-call, ~4K-token run with all peers
    tokenspeed bench prefill                # prefill ms/token vs the cached prefix, TokenSpeed vs llama.cpp, per ISA variant
    tokenspeed bench gpu --out DIR          # the device check (CUDA): kernels, parity, decode vs floor, agent figures, profile
    tokenspeed bench profile                # torch.profiler table of one int4 decode step
    tokenspeed bench kv needle|agreement|cost   # pruned KV cache accuracy and cost (tokenspeed.bench.kv)
    tokenspeed bench auto                   # tool_choice=auto: call/text rates per tool-listing prompt (BFCL)
    tokenspeed bench serve                  # GET /health during bursts of requests on `tokenspeed serve` (< 50 ms)
    tokenspeed bench agreement              # logits vs llama.cpp on the embedded model re-quantized to Q4_0, Q8_0, Q4_K_M
    tokenspeed bench scale                  # load, RSS, ITL and prefill against model size (135M-3B), beside llama.cpp

Peers are an optional extra: `pip install -e ".[bench]"`, and `make peers` builds llama-cpp-python from source.
"""
from __future__ import annotations

import argparse
import json

from ..cli import positive_int, positive_ints
import sys
from pathlib import Path

__all__ = ["add_parser", "main"]


def _cmd_aal(args) -> int:
    from .aal import run_aal
    from .report import print_table

    try:
        report = run_aal(Path(args.out), quick=args.quick, seed=args.seed, threads=args.threads,
                         workload=Path(args.workload) if args.workload else None,
                         engines=args.engines.split(",") if args.engines else None, bfcl_dir=args.bfcl)
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(report)
    print(f"# wrote {Path(args.out) / 'report.json'} and {Path(args.out) / 'aal.png'}", file=sys.stderr)
    return 0


def _cmd_prefill(args) -> int:
    from .prefill import print_table, run_prefill

    try:
        report = run_prefill(Path(args.out), quick=args.quick, threads=args.threads,
                             variants=args.variants.split(",") if args.variants else None, repeats=args.repeats,
                             kv_budget=args.kv_budget or None,
                             llama_cpp_avx2=Path(args.llama_cpp_avx2) if args.llama_cpp_avx2 else None)
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(report)
    print(f"# wrote {Path(args.out) / 'report.json'}", file=sys.stderr)
    return 0


def _cmd_gpu(args) -> int:
    from .gpu import run_gpu

    try:
        res = run_gpu(device=args.device, quick=args.quick, out=Path(args.out) if args.out else None,
                      model=args.model, bfcl=args.bfcl)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        print(f"# wrote {Path(args.out) / 'gpu.json'}", file=sys.stderr)
    return 1 if res["failed"] else 0


def _cmd_kv(args) -> int:
    from .kv import run

    return run(args)


def _cmd_agreement(args) -> int:
    from .agreement import print_table, run_agreement

    try:
        report = run_agreement(Path(args.out), formats=args.formats.split(","), positions=args.positions,
                               threads=args.threads)
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(report)
    print(f"# wrote {Path(args.out) / 'report.json'}", file=sys.stderr)
    return 0


def _cmd_scale(args) -> int:
    from .scale import merge_reports, plot, print_table, run_scale

    try:
        if args.merge:  # the rows of earlier runs as one table and plot
            report = merge_reports([json.loads(Path(f).read_text()) for f in args.merge])
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "report.json").write_text(json.dumps(report, indent=1))
            plot(report, Path(args.out) / "scale.png")
        else:
            report = run_scale(Path(args.out), sizes=args.sizes.split(","), formats=args.formats.split(","),
                               threads=args.threads, repeats=args.repeats,
                               steps=args.steps, quick=args.quick)
    except (RuntimeError, ValueError, KeyError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(report)
    print(f"# wrote {Path(args.out) / 'report.json'} and {Path(args.out) / 'scale.png'}", file=sys.stderr)
    return 0


def _cmd_profile(args) -> int:
    from .decode_profile import profile_decode

    profile_decode(args.model, quantize=None if args.quantize == "none" else args.quantize, threads=args.threads,
                   steps=args.steps, context=args.context)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` (with `aal`, `prefill`, `gpu`, `profile`, `agreement`, `scale`, `kv`, `auto` and `serve`) on an
    argparse subparsers object; returns it."""
    p = subparsers.add_parser("bench", help="benchmarks: aal (agent action latency), prefill, gpu, profile, agreement "
                                            "(vs llama.cpp), scale (cost vs model size), kv (pruned KV cache), auto, serve (/health under load)")
    sub = p.add_subparsers(dest="bench", required=True)
    a = sub.add_parser("aal", help="Agent Action Latency: TokenSpeed vs llama.cpp vs transformers, one run")
    a.add_argument("--quick", action="store_true", help="small workload (2 calls, ~1.4K tokens); skips a missing llama.cpp")
    a.add_argument("--threads", type=positive_int, default=2, help="CPU threads for every engine (default 2)")
    a.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    a.add_argument("--workload", default=None, help="run this workload JSON instead of generating one")
    a.add_argument("--engines", default=None,
                   help="comma-separated subset of tokenspeed:auto (the measured weight choice),tokenspeed:int4,"
                        "tokenspeed:int4:plain (no speculation),tokenspeed:int8,tokenspeed,llama.cpp,transformers "
                        "(default: all but tokenspeed:auto and tokenspeed:int8)")
    a.add_argument("--bfcl", default=None, help="BFCL data folder (default: $TOKENSPEED_BFCL, then the copy shipped with tokenspeed)")
    a.add_argument("--out", default="bench-out/aal", help="output folder (default bench-out/aal)")
    a.set_defaults(func=_cmd_aal)
    pf = sub.add_parser("prefill", help="prefill ms/token after prefixes of 0, 600 and 2,000 tokens: TokenSpeed (per "
                                        "CPU kernel variant) vs llama.cpp, same ids and threads, with the compute floor")
    pf.add_argument("--quick", action="store_true", help="short prefixes, few tokens, one repeat (plumbing check); "
                                                         "skips a missing llama.cpp")
    pf.add_argument("--threads", type=positive_ints, default=[1, 2], help="comma-separated thread counts (default 1,2)")
    pf.add_argument("--variants", default=None, help="comma-separated CPU kernel variants for TokenSpeed "
                                                     "(default: this CPU's best, and avx2 where it differs)")
    pf.add_argument("--repeats", type=int, default=None, help="timed repeats per cell, median (default 3; quick 1)")
    pf.add_argument("--kv-budget", type=int, default=1024, help="also TokenSpeed with a pruned KV cache of this "
                                                                "budget (default 1024, the agent's; 0: not)")
    pf.add_argument("--llama-cpp-avx2", default=None, help="folder of an AVX2 llama-cpp-python build (make peers-avx2: "
                                                           "build/llama-cpp-avx2): TokenSpeed's avx2 rows compare with it")
    pf.add_argument("--out", default="bench-out/prefill", help="output folder (default bench-out/prefill)")
    pf.set_defaults(func=_cmd_prefill)
    g = sub.add_parser("gpu", help="the device check: kernels, parity vs CPU fp32, decode vs the HBM floor, agent "
                                   "figures vs the brief, the idle gaps between a decision's kernels (CUDA; CPU with "
                                   "small shapes); exit 1 if a section failed")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    g.add_argument("--quick", action="store_true", help="small shapes and few tokens (CPU tests)")
    g.add_argument("--out", default=None, help="folder for gpu.json, written after each section")
    g.add_argument("--model", default=None, help="a .gguf file or safetensors folder (default: the embedded model)")
    g.add_argument("--bfcl", default=None, help="BFCL data folder (default: $TOKENSPEED_BFCL, then the copy shipped with tokenspeed)")
    g.set_defaults(func=_cmd_gpu)
    f = sub.add_parser("profile", help="torch.profiler table of one decode step (what limits ITL)")
    f.add_argument("--model", default=None, help="a .gguf file or safetensors folder (default: embedded model)")
    f.add_argument("--quantize", default="auto", choices=["auto", "gguf", "int4", "int8", "none"])
    f.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    f.add_argument("--steps", type=int, default=10, help="decode steps profiled")
    f.add_argument("--context", type=int, default=256, help="tokens in the KV cache (default 256)")
    f.set_defaults(func=_cmd_profile)
    ag = sub.add_parser("agreement", help="top-1 agreement and KL of TokenSpeed's logits against llama.cpp's on the "
                                          "embedded model re-quantized by llama.cpp (teacher-forced agent context)")
    ag.add_argument("--formats", default="Q4_0,Q8_0,Q4_K_M", help="llama.cpp quantization formats (default Q4_0,Q8_0,Q4_K_M)")
    ag.add_argument("--positions", type=int, default=2000, help="positions scored per file (default 2000)")
    ag.add_argument("--threads", type=positive_int, default=2, help="CPU threads of both engines (default 2)")
    ag.add_argument("--out", default="bench-out/agreement", help="output folder (default bench-out/agreement)")
    ag.set_defaults(func=_cmd_agreement)
    from .scale import DEFAULT_SIZES, FORMATS as SCALE_FORMATS, SHAPES

    sc = sub.add_parser("scale", help="random-weight models at real shapes (SmolLM2-135M .. Llama-3.2-3B) quantized by "
                                      "llama.cpp: load, peak RSS, ITL at 512/4,096 tokens of context, prefill, "
                                      "TokenSpeed (the file's own blocks) beside llama.cpp, with the bandwidth floor; "
                                      "the files are kept under <cache>/scale/ (needs llama-cpp-python: make peers)")
    sc.add_argument("--sizes", default=",".join(DEFAULT_SIZES),
                    help=f"comma-separated, of {', '.join(SHAPES)} (default {','.join(DEFAULT_SIZES)})")
    sc.add_argument("--formats", default=",".join(SCALE_FORMATS),
                    help=f"llama.cpp quantization formats (default {','.join(SCALE_FORMATS)})")
    sc.add_argument("--threads", type=positive_ints, default=[1, 2], help="comma-separated thread counts (default 1,2)")
    sc.add_argument("--repeats", type=int, default=2, help="timed prefills per cell, median (default 2)")
    sc.add_argument("--steps", type=int, default=16, help="timed decode steps per context, median (default 16)")
    sc.add_argument("--quick", action="store_true", help="contexts of 32 and 96 tokens, prefills of 8 and 24 (plumbing)")
    sc.add_argument("--merge", nargs="+", default=None, metavar="REPORT",
                    help="measure nothing: join these report.json files (e.g. one size each) into one table and plot")
    sc.add_argument("--out", default="bench-out/scale", help="output folder (default bench-out/scale)")
    sc.set_defaults(func=_cmd_scale)
    from .auto import add_parser as add_auto_parser
    from .serve import add_parser as add_serve_parser

    add_auto_parser(sub)
    add_serve_parser(sub)
    from .kv import add_subcommands

    k = sub.add_parser("kv", help="pruned, tiered KV cache: needle / agreement / cost (see tokenspeed.bench.kv)")
    add_subcommands(k.add_subparsers(dest="what", required=True))
    k.set_defaults(func=_cmd_kv)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenspeed.bench ...` / `tokenspeed bench ...` entry."""
    parser = argparse.ArgumentParser(prog="tokenspeed")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench"] + list(sys.argv[1:] if argv is None else argv))
    return args.func(args)
