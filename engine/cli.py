"""The `tokenspeed` command line.

    tokenspeed call --tools tools.json --prompt "Pick up the red cube."   # one tool call + timings
    tokenspeed generate --prompt "Write a haiku about robots."             # streams text
    tokenspeed draft build-data|train|eval                                 # draft-model recipe
    tokenspeed bench aal [--quick] | gpu | profile                         # latency benchmark vs peers
    tokenspeed bench kv needle|agreement|cost                              # pruned KV cache accuracy and cost
    tokenspeed bench prefill | agreement | scale                           # prefill, logits and model size vs llama.cpp
    tokenspeed bench auto                                                  # tool_choice=auto call/text rates (BFCL)
    tokenspeed bench serve                                                 # /health during request bursts on serve
    tokenspeed serve [--port 8000]                                         # OpenAI-compatible HTTP server
    tokenspeed <subcommand> --help

`--model` takes a .gguf file, a Hugging Face safetensors folder, or nothing (the embedded
SmolLM2-135M-Instruct).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive, finite number of seconds")
    return value


def _message(text: str) -> str:
    """argparse type: a user message with some text in it (not empty or only whitespace)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the user message is empty")
    return text


def positive_int(text: str) -> int:
    """argparse type: an integer > 0 (e.g. --max-tokens), refused before the model loads."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers > 0 (e.g. --threads 1,2 of a benchmark)."""
    return [positive_int(part.strip()) for part in text.split(",")]


def _port(text: str) -> int:
    """argparse type: a TCP port, 0..65535 (0: any free port), refused before the model loads."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port number (0-65535; 0: any free port)")
    return value


def _engine(args):
    from . import Engine

    t0 = time.perf_counter()
    engine = Engine.load(args.model, threads=args.threads, quantize=None if args.quantize == "none" else args.quantize,
                         device=args.device, dtype=args.dtype)
    print(f"# model {engine.source} loaded in {time.perf_counter() - t0:.2f} s, {engine.weights} weights on "
          f"{engine.device}", file=sys.stderr)
    if engine.weight_choice is not None:
        print(f"# {engine.weight_choice.describe()}", file=sys.stderr)
    return engine


def cmd_call(args) -> int:
    """Answer one prompt with one schema-valid tool call (or, under --tool-choice auto, a text
    answer); print it and the timings as JSON. Exit status 0 for either, else 1."""
    from .grammar import normalize_tools
    from .tools import ToolsFileError, load_tools

    tools = normalize_tools(load_tools(args.tools))  # before the model loads: a bad file fails at once
    if not tools:
        raise ToolsFileError(f"--tools {args.tools} holds no tools: `call` answers with one of them")
    names = [t["function"]["name"] for t in tools]
    if args.tool is not None and args.tool not in names:
        raise ToolsFileError(f"--tool {args.tool!r} is not in {args.tools} (tools: {', '.join(names)})")
    engine = _engine(args)
    session = engine.session(system=args.system, tools=tools)
    tool_choice = {"name": args.tool} if args.tool else args.tool_choice
    t0 = time.perf_counter()
    observed = session.observe(args.prompt)
    observe_s = time.perf_counter() - t0
    decision = session.decide(tool_choice=tool_choice, deadline=args.deadline, max_tokens=args.max_tokens)
    report = {"status": decision.status, "tool_call": decision.tool_call, "reason": decision.reason or None,
              "text": decision.text if decision.status != "ok" else None,
              # the prompt's tokens are prefilled by observe; the decision's prefill_tokens are its trigger's
              "timings": {"observe_prefill_ms": observe_s * 1e3, "observe_prefill_tokens": observed,
                          **decision.timings()}}
    print(json.dumps(report, indent=2))
    return 0 if decision.status == "ok" or (decision.status == "text" and tool_choice == "auto") else 1


def cmd_generate(args) -> int:
    """Stream a plain-text chat completion."""
    engine = _engine(args)
    session = engine.session(system=args.system)
    t0 = time.perf_counter()
    session.generate(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                     seed=args.seed, on_token=lambda piece: print(piece, end="", flush=True))
    print(f"\n# {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    """Load the engine and serve the OpenAI-compatible API until interrupted."""
    from . import EngineArgumentError

    if args.queue_size < 0 or args.context < 64 or args.cache_budget_mb <= 0 or args.max_body_mb <= 0:
        raise EngineArgumentError("--queue-size must be >= 0, --context >= 64, --cache-budget-mb and --max-body-mb > 0")
    try:
        from .serve import listen, serve
    except ImportError as exc:
        raise SystemExit(f"error: tokenspeed serve needs the serve extra (pip install 'tokenspeed_ros[serve]'): {exc}")
    try:
        sock = listen(args.host, args.port)  # before the model loads: a port in use fails at once
    except OSError as exc:
        raise SystemExit(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    serve(_engine(args), sock, args.served_model_name, args.queue_size, int(args.cache_budget_mb * (1 << 20)),
          args.context, int(args.max_body_mb * (1 << 20)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with all subcommands."""
    from .device import DTYPES  # imports torch: inside main's Ctrl-C handling, as the other heavy imports

    parser = argparse.ArgumentParser(prog="tokenspeed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def device_args(p):
        p.add_argument("--device", default="auto",
                       help="auto (default: CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N")
        p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                       help="weights and KV cache: auto (default: bfloat16 on CUDA, float32 on the CPU) or a dtype")

    def model_args(p):
        p.add_argument("--model", default=None,
                       help="a .gguf file or safetensors folder (default: embedded SmolLM2-135M-Instruct)")
        p.add_argument("--threads", type=positive_int, default=None,
                       help="torch threads (> 0, default: torch's choice)")
        device_args(p)
        p.add_argument("--quantize", default="auto", choices=["auto", "gguf", "int4", "int8", "none"],
                       help="weights: auto (default: a quantized .gguf file's own blocks; other models the fastest "
                            "format on this CPU whose greedy tokens agree with fp32's, measured once and cached), gguf (a .gguf file's own blocks, read without an "
                            "fp32 copy), int4 (4-bit groups of 32 re-derived from fp32), int8 or none (fp32)")
        p.add_argument("--system", default=None, help="system prompt")
        p.add_argument("--prompt", required=True, type=_message, help="user message (not empty)")
        p.add_argument("--max-tokens", type=positive_int, default=256, help="most new tokens (> 0, default 256)")

    p = sub.add_parser("call", help="answer a prompt with one schema-valid tool call")
    model_args(p)
    p.add_argument("--tools", required=True, help="JSON file with a list of OpenAI tool definitions")
    p.add_argument("--tool-choice", default="required", choices=["required", "auto"],
                   help="required (default): always one tool call; auto: the model may answer in text instead")
    p.add_argument("--tool", default=None, help="force this tool (tool_choice={'name': TOOL})")
    p.add_argument("--deadline", type=_positive_seconds, default=None,
                   help="deadline in seconds for the decision (> 0)")
    p.set_defaults(func=cmd_call)

    p = sub.add_parser("generate", help="stream a plain-text answer")
    model_args(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=cmd_generate)

    from .draft import add_parser as add_draft_parser
    add_draft_parser(sub)  # tokenspeed draft build-data | train | eval

    from .bench import add_parser as add_bench_parser
    add_bench_parser(sub)  # tokenspeed bench aal | gpu | profile | kv | auto | serve

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat completions, tools, streaming)")
    p.add_argument("--model", default=None,
                   help="a .gguf file, a safetensors folder or tiny-random (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (> 0, default: torch's choice)")
    p.add_argument("--quantize", default="auto", choices=["auto", "gguf", "int4", "int8", "none"],
                   help="weights: auto (default: a quantized .gguf file's own blocks, else the measured fastest "
                        "format), gguf (the .gguf file's own), int4, "
                        "int8 or none (fp32)")
    device_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port, 0-65535 (default 8000; 0: any free port)")
    p.add_argument("--served-model-name", default="tokenspeed", help="the model id clients use (default tokenspeed)")
    p.add_argument("--queue-size", type=int, default=8, help="requests that may wait behind the running one (default 8; more: 429)")
    p.add_argument("--context", type=positive_int, default=4096, help="KV capacity per conversation, tokens (default 4096)")
    p.add_argument("--cache-budget-mb", type=float, default=1024.0,
                   help="KV memory the warm conversations may hold, MiB (default 1024; least recently used evicted beyond)")
    p.add_argument("--max-body-mb", type=float, default=8.0,
                   help="largest request body, MiB (default 8; larger: 413)")
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tokenspeed` console script. Bad input: one `error:` line, exit 2; Ctrl-C at any
    point (the first seconds import torch): one `# tokenspeed <command>: interrupted (SIGINT)` line, exit 130."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _run(argv)
    except KeyboardInterrupt:  # before the command finished (importing torch, loading the model...): one line
        name = " ".join(["tokenspeed", *[a for a in argv if not a.startswith("-")][:1]])  # + the subcommand
        print(f"# {name}: interrupted (SIGINT)", file=sys.stderr)
        return 130


def _run(argv: list[str]) -> int:
    """Parse `argv` and run its subcommand; bad input (arguments, files, schemas, model, device) is one
    `error:` line and exit 2, as argparse's usage errors."""
    from . import DeviceError, EngineArgumentError, ModelLoadError, SessionArgumentError, ToolSchemaError
    from .kernels.cpu_decode import CpuVariantError
    from .tools import ToolsFileError

    args = build_parser().parse_args(argv)
    # the engine's own notices on stderr (the auto format's one-time measurement and its choice)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("tokenspeed").setLevel(logging.INFO)
    try:
        return args.func(args)
    except (ModelLoadError, CpuVariantError, DeviceError, EngineArgumentError, SessionArgumentError, ToolSchemaError,
            ToolsFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
