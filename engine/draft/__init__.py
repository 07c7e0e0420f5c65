"""The agent-specific draft recipe: `tokenspeed draft build-data | train | eval`.

    tokenspeed draft build-data --out build/draft/data.jsonl       # target answers agent tasks
    tokenspeed draft train --data build/draft/data.jsonl --out build/draft --install
    tokenspeed draft eval --data build/draft/data.jsonl             # acceptance per drafter
    tokenspeed draft speedup --threads 1                            # AAL turns, spec vs plain

`--install` writes the trained draft to the package's default path
(`tokenspeed/data/draft-smollm2-135m.safetensors`), which `Engine` loads automatically when it
matches the target. See `tokenspeed.draft.data`, `.train`, `.evaluate` and `.speedup` for the method.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli import positive_int

__all__ = ["main", "add_parser"]


def _engine(args):
    from .. import Engine

    return Engine.load(args.model, threads=args.threads, quantize=args.quantize)


def cmd_build_data(args) -> int:
    """Generate the self-distillation dataset."""
    from .data import agent_workloads, bfcl_tasks, build_data, robot_tasks, trading_tasks

    tasks = robot_tasks(args.robot, args.seed) + trading_tasks(args.trading, args.seed)
    if args.bfcl_limit != 0:
        tasks += bfcl_tasks(args.bfcl, None if args.bfcl_limit < 0 else args.bfcl_limit)
    report = build_data(_engine(args), tasks, Path(args.out), max_tokens=args.max_tokens, resume=args.resume,
                        workloads=agent_workloads(args.agent, args.seed, args.agent_calls))
    print(json.dumps(report, indent=1))
    return 0


def cmd_train(args) -> int:
    """Train the draft model and print the held-out report."""
    from ..speculation import DEFAULT_DRAFT
    from .train import train

    report = train(_engine(args), Path(args.data), Path(args.out), epochs=args.epochs, lr=args.lr,
                   n_layers=args.layers, hidden_dim=args.hidden, vocab_size=args.vocab, aux_weight=args.aux_weight,
                   checkpoint_every=args.checkpoint_every, resume=args.resume, seed=args.seed,
                   window=None if args.window == 0 else args.window,
                   install=DEFAULT_DRAFT if args.install else None)
    print(json.dumps(report, indent=1))
    return 0


def cmd_eval(args) -> int:
    """Acceptance and speed per drafter on the held-out split."""
    from ..speculation import DEFAULT_DRAFT, DraftModel
    from .evaluate import analyze, evaluate, verify_cost

    engine = _engine(args)
    path = Path(args.draft) if args.draft else DEFAULT_DRAFT
    draft = None if args.no_draft else DraftModel.load(path, engine.model)
    if args.analyze:
        report = analyze(engine, Path(args.data), draft)
    else:
        report = evaluate(engine, Path(args.data), draft, k=args.k, limit=args.limit, repeats=args.repeats,
                          families=args.family)
    report["draft"] = None if draft is None else str(path)
    if args.verify_cost:
        report["verify_forward_ms"] = verify_cost(engine)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


def cmd_speedup(args) -> int:
    """Decision latency on the AAL turns, speculative vs plain, alternating in one process."""
    from ..speculation import DEFAULT_DRAFT, DraftModel
    from .speedup import speedup

    engine = _engine(args)
    path = Path(args.draft) if args.draft else DEFAULT_DRAFT
    draft = None if args.no_draft else DraftModel.load(path, engine.model)
    report = speedup(engine, draft, seed=args.seed, quick=args.quick, n_calls=args.calls, repeats=args.repeats)
    report.update(draft=None if draft is None else str(path), threads=args.threads, quantize=args.quantize)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


def _guarded(cmd):
    """Bad paths and mismatched files end the command with a one-line error, not a traceback."""
    def run(args) -> int:
        from .. import ModelLoadError

        try:
            return cmd(args)
        except (ModelLoadError, FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"error: {exc}")
    return run


def add_parser(sub) -> None:
    """Add the `draft` subcommand (with build-data, train, eval) to an argparse subparsers object."""
    draft = sub.add_parser("draft", help="agent-specific draft model recipe: build-data, train, eval",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = draft.add_subparsers(dest="step", required=True)

    def common(p):
        p.add_argument("--model", default=None, help="target .gguf/safetensors (default: embedded SmolLM2-135M)")
        p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
        p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                       help="target weights (default fp32; the ROS nodes run int4)")
        p.add_argument("--seed", type=int, default=0)

    p = steps.add_parser("build-data", help="answer robot, trading and BFCL tasks with the target")
    common(p)
    p.add_argument("--out", default="build/draft/data.jsonl", help="dataset file (JSON lines)")
    p.add_argument("--robot", type=int, default=150, help="robot-arm tasks (every 5th held out)")
    p.add_argument("--trading", type=int, default=150, help="trading tasks (every 5th held out)")
    p.add_argument("--bfcl", default=None, help="BFCL folder (default: tokenspeed.bfcl.bfcl_dir())")
    p.add_argument("--bfcl-limit", type=int, default=-1, help="first N BFCL cases (-1: all 400, 0: none)")
    p.add_argument("--agent", type=int, default=60,
                   help="AAL-format agent sessions (seeds SEED+1..; every 5th held out)")
    p.add_argument("--agent-calls", type=int, default=10, help="decisions per agent session")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens per call")
    p.add_argument("--resume", action="store_true", help="keep OUT's rows, answer only the tasks not in it")
    p.set_defaults(func=_guarded(cmd_build_data))

    p = steps.add_parser("train", help="train the draft on the dataset's train split")
    common(p)
    p.add_argument("--data", default="build/draft/data.jsonl")
    p.add_argument("--out", default="build/draft", help="checkpoint.pt, draft.safetensors, report.json")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=1, help="draft decoder layers")
    p.add_argument("--hidden", type=int, default=768, help="draft SwiGLU width")
    p.add_argument("--vocab", type=int, default=4096, help="draft output vocabulary (tokens)")
    p.add_argument("--aux-weight", type=float, default=0.0, help="loss weight of grammar-forced tokens")
    p.add_argument("--window", type=int, default=1024,
                   help="context tokens the draft attends over (last WINDOW..1.5 WINDOW; 0: all)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--install", action="store_true", help="also write the package's default draft")
    p.set_defaults(func=_guarded(cmd_train))

    p = steps.add_parser("eval", help="acceptance rate and length per drafter on the held-out split")
    common(p)
    p.add_argument("--data", default="build/draft/data.jsonl")
    p.add_argument("--draft", default=None, help="draft .safetensors (default: the shipped one)")
    p.add_argument("--no-draft", action="store_true", help="evaluate prompt lookup and grammar runs only")
    p.add_argument("--k", type=int, default=6, help="fixed proposal length for the acceptance settings")
    p.add_argument("--limit", type=int, default=None, help="most held-out rows per task family")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats per row and setting")
    p.add_argument("--family", action="append", choices=["robot", "trading", "bfcl"], help="only these")
    p.add_argument("--verify-cost", action="store_true", help="also time target forwards over 1..16 tokens")
    p.add_argument("--analyze", action="store_true",
                   help="teacher-forced rejection analysis per token class and confidence gate (no replay)")
    p.add_argument("--json", default=None, help="also write the report here")
    p.set_defaults(func=_guarded(cmd_eval))

    p = steps.add_parser("speedup", help="AAL decision latency with vs without speculation (same process)")
    common(p)
    p.add_argument("--draft", default=None, help="draft .safetensors (default: the shipped one)")
    p.add_argument("--no-draft", action="store_true", help="speculate with prompt lookup and grammar runs only")
    p.add_argument("--quick", action="store_true", help="the quick AAL workload (2 turns)")
    p.add_argument("--calls", type=int, default=None, help="decisions in the workload (default 10, quick 2)")
    p.add_argument("--repeats", type=int, default=5, help="decisions per turn and setting (medians)")
    p.add_argument("--json", default=None, help="also write the report here")
    p.set_defaults(func=_guarded(cmd_speedup))


def main(argv: list[str] | None = None) -> int:
    """`tokenspeed draft ...` on its own (argv without the leading "draft")."""
    parser = argparse.ArgumentParser(prog="tokenspeed")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["draft", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)
