"""Accuracy and cost of the relevance-pruned, tiered KV cache (`tokenspeed.kv`) on a real model.

    tokenspeed bench kv needle --budget 512            # (a) 20 cases, 3000 stream tokens each
    tokenspeed bench kv agreement --history 4096 --budgets 1024 512      # (b) greedy agreement, KL
    tokenspeed bench kv cost --history 1024 4096 16384 --budget 1024 --llamacpp  # ITL / TTFT
    (or python -m tokenspeed.bench.kv ...; --model, --threads, --json PATH after the subcommand)

Each prints a table and, with --json PATH, writes the rows. The functions `needle`, `agreement`
and `cost` return the rows (lists of dicts) for other benchmarks to call.

Workload: a robot agent whose early context holds a safety note ("part_07 is fragile. Always
grasp part_07 with force 3."), followed by a stream of observations of four short lines each,
alternating sensor frames (`kind="sensor"`, sources "arm" and "cell", superseded by newer
frames) and event-log lines (`kind="text"`, never superseded), then the question ("Grasp
part_07 now."). All text is generated from a seeded RNG. The workload is one the 135M model
solves with the full cache at 3K tokens (checked first, so the comparison is not vacuous): it
fails with the full cache when each reading is its own chat turn (~15 tokens per turn; 0/3 at
1.5K tokens), when one context holds five notes (0/5 at 3K), or when event lines name parts.
At 8K stream tokens (8.3-8.4K in context, just past SmolLM2's trained 8192) the full cache
answered force 1 in 20/20 cases, right only where the note says 1: there the benchmark cannot
tell a kept fact from a lost one (measured, budget 512: pruned+cold made the same 20 calls).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from ..cli import positive_int
from ..kv import KVConfig

PARTS = [f"part_{i:02d}" for i in range(1, 21)]
SYSTEM = "You control a robot arm. Follow the operator's safety notes exactly."
TOOLS = [{"type": "function", "function": {
    "name": "grasp", "description": "Grasp a part with the gripper.",
    "parameters": {"type": "object", "properties": {
        "object": {"type": "string", "enum": PARTS},
        "force": {"type": "integer", "minimum": 1, "maximum": 9, "description": "Grip force level."}},
        "required": ["object", "force"], "additionalProperties": False}}}]


def _reading(rng: random.Random, i: int) -> tuple[str, str, str]:
    """Observation `i` of the stream as (text, kind, source): four short lines each. Even i: a
    sensor frame (kind "sensor"; sources "arm" and "cell" alternate, so each frame supersedes
    the one before the last); odd i: four event-log lines (kind "text", never superseded)."""
    if i % 2:
        return "\n".join(f"event {2 * i + j:05d}: conveyor {rng.randint(1, 4)} moved {rng.randint(0, 30)} items."
                         for j in range(4)), "text", ""
    if (i // 2) % 2:
        return (f"cell: conveyor speed {rng.uniform(0.1, 0.9):.2f} m/s\ncell: station temperature "
                f"{rng.uniform(20, 40):.1f} C\ncell: queue {rng.randint(0, 30)} items\ncell: light "
                f"{rng.choice(['green', 'amber'])}"), "sensor", "cell"
    return (f"arm: wrist force {rng.uniform(0, 5):.1f} N\narm: gripper width {rng.randint(0, 80)} mm\n"
            f"arm: elbow {rng.uniform(-2, 2):.2f} rad\narm: base {rng.uniform(-2, 2):.2f} rad"), "sensor", "arm"


def _stream(session, rng: random.Random, tokens: int) -> float:
    """Observe `_reading`s until `tokens` more tokens are in the context; returns seconds."""
    t0, target, i = time.perf_counter(), session.num_tokens + tokens, 0
    while session.num_tokens < target:
        text, kind, source = _reading(rng, i)
        session.observe(text, kind=kind, source=source)
        i += 1
    return time.perf_counter() - t0


def _session(engine, kv: KVConfig | None):
    return engine.session(system=SYSTEM, tools=TOOLS, kv_budget=kv)    # full: the model's max_position_embeddings


def needle(engine, configs: dict[str, KVConfig | None], streams=(3000,) * 20, facts: int = 1,
           seed: int = 0, log=print) -> list[dict]:
    """(a) Needle in a sensor stream: per stream length, `facts` safety notes, then the stream,
    then one `grasp` question per note (checkpoint / decide / rollback, so questions do not see
    each other). A case passes when the call names the part and the noted force.

    Returns one row per (config, stream, fact): config, stream (tokens), part, force,
    status, call, correct (bool), kv (metrics), ttft_ms.
    """
    rows = []
    for si, n_stream in enumerate(streams):
        rng = random.Random(seed + si)
        notes = [(p, rng.randint(1, 9)) for p in rng.sample(PARTS, facts)]
        for name, kv in configs.items():
            s = _session(engine, kv)
            for part, force in notes:
                s.observe(f"Safety note: {part} is fragile. Always grasp {part} with force {force}.")
            prefill_s = _stream(s, random.Random(seed + 100 + si), n_stream)
            log(f"# {name} stream {n_stream}: {s.num_tokens} tokens, prefill {prefill_s:.1f} s")
            for part, force in notes:
                cp = s.checkpoint()
                s.observe(f"Grasp {part} now.")
                d = s.decide(tool_choice="required")
                ok = d.ok and d.tool_call["arguments"] == {"object": part, "force": force}
                rows.append(dict(config=name, stream=n_stream, part=part, force=force, status=d.status,
                                 call=d.tool_call, correct=ok, kv=d.kv, ttft_ms=d.ttft_s * 1e3))
                log(f"  {name} {part} force {force}: {d.tool_call and d.tool_call['arguments']} "
                    f"{'ok' if ok else 'WRONG'} kv={d.kv and {k: d.kv[k] for k in ('hot', 'cold', 'recalled')}}")
                s.rollback(cp)
    return rows


def _teacher_forced_logits(session, prompt: str, tokens: list[int]) -> torch.Tensor:
    # Logits [len(tokens), V] for each next token after `prompt`, feeding `tokens` one at a time.
    session.observe(prompt)
    session._append(session.tok.encode(session.tok.assistant_prefix), "assistant")
    feed, session.pending = session.pending, []
    out = []
    for t in tokens:
        out.append(session._forward(feed)[0])
        feed = [t]
    return torch.stack(out)


def agreement(engine, history: int = 4096, budgets=(1024, 512), cold: int = 4096, gen: int = 48,
              traces: int = 2, seed: int = 0, log=print) -> list[dict]:
    """(b) Greedy agreement and KL(full || pruned) of next-token distributions on long agent
    traces: the full-cache session generates `gen` tokens greedily; each pruned session is fed
    the same tokens (teacher forcing). Returns rows: trace, budget, cold, agree (fraction of
    positions with the same argmax), kl_mean, kl_max (nats), hot_fraction."""
    rows = []
    for tr in range(traces):
        question = "Summarise the last events and say which part should be grasped next, and with what force."
        rng = random.Random(seed + tr)
        full = _session(engine, None)
        notes = [(p, rng.randint(1, 9)) for p in rng.sample(PARTS, 5)]
        for part, force in notes:
            full.observe(f"Safety note: {part} is fragile. Always grasp {part} with force {force}.")
        _stream(full, random.Random(seed + 200 + tr), history - full.num_tokens)
        n_ctx = full.num_tokens
        ref_tokens, ref_logits = [], []
        full.observe(question)
        full._append(full.tok.encode(full.tok.assistant_prefix), "assistant")
        feed, full.pending = full.pending, []
        for _ in range(gen):
            logits = full._forward(feed)[0]
            ref_logits.append(logits)
            feed = [int(logits.argmax())]
            ref_tokens.append(feed[0])
        ref = torch.stack(ref_logits)
        log(f"# trace {tr}: {n_ctx} tokens; full cache says {full.tok.decode(ref_tokens)!r}")
        for budget in budgets:
            for c in ((0, cold) if cold else (0,)):
                s = _session(engine, KVConfig(budget=budget, cold=c))
                rng = random.Random(seed + tr)
                for part, force in [(p, rng.randint(1, 9)) for p in rng.sample(PARTS, 5)]:
                    s.observe(f"Safety note: {part} is fragile. Always grasp {part} with force {force}.")
                _stream(s, random.Random(seed + 200 + tr), history - s.num_tokens)
                got = _teacher_forced_logits(s, question, ref_tokens)
                lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
                kl = (lp.exp() * (lp - lq)).sum(-1)
                row = dict(trace=tr, history=n_ctx, budget=budget, cold=c,
                           agree=float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                           kl_mean=float(kl.mean()), kl_max=float(kl.max()), hot_fraction=budget / n_ctx,
                           kv=s.cache.take_metrics())
                rows.append(row)
                log(f"  budget {budget} cold {c}: agree {row['agree']:.3f} KL mean {row['kl_mean']:.4f} max {row['kl_max']:.3f}")
    return rows


def cost(engine, histories=(1024, 4096, 16384), budget: int = 1024, decisions: int = 3, seed: int = 0,
         full_upto: int = 4096, recall_room: int | None = None, log=print) -> list[dict]:
    """Decision TTFT and ITL (ms) after `histories` tokens of stream (`_reading` observations),
    pruned to `budget` (with a cold tier), and with the full cache for histories <= full_upto.
    All sessions are built first, then their decisions run interleaved (round-robin), so that
    load drift on a shared machine hits every configuration alike. Each decision observes a
    question, then decides without jump-forward so every token is a decode step. Returns rows:
    config, history, ttft_ms (decide() to first token, median), q_ttft_ms (the question's
    observe() plus ttft: what `llamacpp_cost` times), itl_ms (median over all decode steps), hot,
    cold (tokens; hot = the most hot slots at the end of a decision: recalls grow it past the
    budget, up to budget + reserve), kv_bytes (hot tier allocation), rss_mb (peak resident set
    of the process)."""
    import resource

    sessions = []
    for h in histories:
        for name, kv in (("pruned", KVConfig(budget=budget, recall_room=recall_room)), ("full", None)):
            if kv is None and h > full_upto:
                continue
            s = _session(engine, kv)
            prefill_s = _stream(s, random.Random(seed + h), h - s.num_tokens)
            log(f"# {name} history {s.num_tokens}: prefill {prefill_s:.1f} s")
            sessions.append((name, h, kv, s, [], [], [], []))
    for i in range(decisions):
        for name, h, kv, s, ttft, q_ttft, itl, peak in sessions:
            cp = s.checkpoint()
            t0 = time.perf_counter()
            s.observe(f"Grasp {PARTS[i % len(PARTS)]} now.")
            q_s = time.perf_counter() - t0
            d = s.decide(tool_choice="required", jump_forward=False)
            ttft.append(d.ttft_s * 1e3)
            q_ttft.append((q_s + d.ttft_s) * 1e3)
            itl.extend(x * 1e3 for x in d.itl_s)
            peak.append(s.cache.n)
            s.rollback(cp)
    rows = []
    for name, h, kv, s, ttft, q_ttft, itl, peak in sessions:
        kv_bytes = s.cache.k.numel() * s.cache.k.element_size() * 2
        row = dict(config=name, history=h, budget=budget if kv else None, ttft_ms=statistics.median(ttft),
                   q_ttft_ms=statistics.median(q_ttft), itl_ms=statistics.median(itl), hot=max(peak),
                   cold=s.cache.cold.tokens if kv and s.cache.cold is not None else 0,
                   kv_bytes=kv_bytes, rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        rows.append(row)
        log(f"  {name} history {h}: TTFT {row['ttft_ms']:.1f} ms (with question {row['q_ttft_ms']:.1f}), ITL {row['itl_ms']:.1f} ms, "
            f"hot {row['hot']}, cold {row['cold']}, KV alloc {kv_bytes / 2**20:.0f} MiB")
    return rows


def llamacpp_cost(engine, histories=(1024, 4096, 16384), decisions: int = 3, threads: int = 2, gen: int = 16,
                  seed: int = 0, log=print) -> list[dict]:
    """The same decision after the same histories with llama.cpp (llama-cpp-python, the embedded
    Q4_1 GGUF, full KV cache, automatic prefix reuse): the history is evaluated untimed, then each
    decision prompt (question + assistant header) is timed to its first token and `gen` greedy
    tokens (no grammar). Needs the `bench` extra. Returns rows like `cost` (config "llama.cpp";
    its TTFT includes the question's prefill, so it is q_ttft_ms and ttft_ms is None). Histories
    past the model's trained context (8192 for SmolLM2) run with n_ctx raised past it (llama.cpp
    warns; positions beyond training, as for the pruned cache)."""
    from llama_cpp import Llama

    from ..grammar import tools_system_prompt
    from ..weights import default_model_path

    tok = engine.tokenizer
    system = [{"role": "system", "content": tools_system_prompt(SYSTEM, TOOLS)}]
    head = tok.render_chat(system)

    def ids(messages):  # tokens of messages rendered after the system turn (as Session does)
        return tok.encode(tok.render_chat(system + messages)[len(head):])

    rows = []
    for h in histories:
        rng, context, i = random.Random(seed + h), tok.encode(head), 0
        while len(context) < h:  # the same observations as `cost`'s sessions, one user turn each
            context += ids([{"role": "user", "content": _reading(rng, i)[0]}])
            i += 1
        llm = Llama(model_path=str(default_model_path()), n_ctx=len(context) + 512, n_threads=threads,
                    n_threads_batch=threads, n_batch=512, seed=0, verbose=False)
        llm.eval(context)
        ttft, itl = [], []
        for d in range(decisions):
            prompt = context + ids([{"role": "user", "content": f"Grasp {PARTS[d]} now."}]) + tok.encode(tok.assistant_prefix)
            t0, stamps = time.perf_counter(), []
            for _ in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
                stamps.append(time.perf_counter())
                if len(stamps) >= gen:
                    break
            ttft.append((stamps[0] - t0) * 1e3)
            itl.extend((b - a) * 1e3 for a, b in zip(stamps, stamps[1:]))
        row = dict(config="llama.cpp", history=len(context), budget=None, ttft_ms=None,
                   q_ttft_ms=statistics.median(ttft), itl_ms=statistics.median(itl), hot=len(context), cold=0)
        rows.append(row)
        log(f"  llama.cpp history {len(context)}: TTFT (with question) {row['q_ttft_ms']:.1f} ms, ITL {row['itl_ms']:.1f} ms")
        del llm
    return rows


def _cost_table(rows: list[dict], base: int) -> None:
    # Markdown table; ratios against the pruned session at the smallest (budget-size) history.
    ref = next((r for r in rows if r["config"] == "pruned" and r["history"] == base), None)

    def ratio(r, key):
        return f"{r[key] / ref[key]:.2f}x" if ref and r[key] is not None else "-"

    print("\n| config | history | TTFT ms | x | TTFT+question ms | x | ITL ms | x | hot | cold |\n" + "|---" * 10 + "|")
    for r in rows:
        ttft = f"{r['ttft_ms']:.1f}" if r["ttft_ms"] is not None else "-"
        print(f"| {r['config']} | {r['history']} | {ttft} | {ratio(r, 'ttft_ms')} | {r['q_ttft_ms']:.1f} | "
              f"{ratio(r, 'q_ttft_ms')} | {r['itl_ms']:.1f} | {ratio(r, 'itl_ms')} | {r['hot']} | {r['cold']} |")


def add_subcommands(sub) -> None:
    """Register needle, agreement and cost on an argparse subparsers object (dest "what")."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help=".gguf file or HF folder (default: embedded SmolLM2-135M)")
    common.add_argument("--threads", type=positive_int, default=None)
    common.add_argument("--json", default=None, help="write the rows to this file")
    a = sub.add_parser("needle", parents=[common], help="(a) needle in a sensor stream")
    a.add_argument("--stream", type=int, nargs="+", default=[3000] * 20,
                   help="stream tokens per session (one session each, with its own notes)")
    a.add_argument("--facts", type=int, default=1, help="safety notes per session")
    a.add_argument("--seed", type=int, default=0, help="stream i uses seed + i")
    a.add_argument("--budget", type=int, default=1024)
    a.add_argument("--cold", type=int, default=4096)
    a.add_argument("--configs", nargs="+", default=["full", "pruned", "pruned+cold"],
                   choices=["full", "pruned", "pruned+cold"])
    b = sub.add_parser("agreement", parents=[common], help="(b) greedy agreement and KL vs the full cache")
    b.add_argument("--history", type=int, default=4096)
    b.add_argument("--budgets", type=int, nargs="+", default=[1024, 512])
    b.add_argument("--cold", type=int, default=4096)
    b.add_argument("--gen", type=int, default=48)
    b.add_argument("--traces", type=int, default=2)
    c = sub.add_parser("cost", parents=[common], help="decision TTFT / ITL vs history length")
    c.add_argument("--history", type=int, nargs="+", default=[1024, 4096, 16384])
    c.add_argument("--budget", type=int, default=1024)
    c.add_argument("--decisions", type=int, default=3)
    c.add_argument("--llamacpp", action="store_true", help="also time llama.cpp at the same histories")
    c.add_argument("--recall-room", type=int, default=None, help="KVConfig.recall_room (tokens)")
    c.add_argument("--speculation", choices=["on", "off"], default="on",
                   help="on: the engine's speculation (in pruned sessions the draft attends over the last "
                        "`budget` tokens); off: plain decoding")


def run(args) -> int:
    """Run the parsed `needle` / `agreement` / `cost` command (see `add_subcommands`)."""
    from .. import Engine

    engine = Engine.load(args.model, threads=args.threads)
    log = lambda *x: print(*x, flush=True)  # noqa: E731
    if args.what == "needle":
        configs = {"full": None, "pruned": KVConfig(budget=args.budget, cold=0),
                   "pruned+cold": KVConfig(budget=args.budget, cold=args.cold)}
        configs = {k: v for k, v in configs.items() if k in args.configs}
        rows = needle(engine, configs, args.stream, args.facts, seed=args.seed, log=log)
        print("\n| config | cases | correct | accuracy |\n|---|---|---|---|")
        for name in configs:
            r = [x for x in rows if x["config"] == name]
            print(f"| {name} | {len(r)} | {sum(x['correct'] for x in r)} | {sum(x['correct'] for x in r) / len(r):.2f} |")
        full = [x["correct"] for x in rows if x["config"] == "full"]  # every config runs the cases in one order
        for name in [c for c in configs if c != "full"] if full else ():
            got = [x["correct"] for x in rows if x["config"] == name]
            same = sum(a == b for a, b in zip(full, got))
            worse = [args.seed + i for i, (a, b) in enumerate(zip(full, got)) if a and not b]
            better = [args.seed + i for i, (a, b) in enumerate(zip(full, got)) if b and not a]
            print(f"# {name}: same outcome as full cache in {same}/{len(full)} cases; "
                  f"wrong where full is right: seeds {worse}; right where full is wrong: seeds {better}")
    elif args.what == "agreement":
        rows = agreement(engine, args.history, args.budgets, args.cold, args.gen, args.traces, log=log)
    else:
        if args.speculation == "off":
            engine.speculation = None
        rows = cost(engine, args.history, args.budget, args.decisions, recall_room=args.recall_room, log=log)
        if args.llamacpp:
            rows += llamacpp_cost(engine, args.history, args.decisions, threads=args.threads or 2, log=log)
        _cost_table(rows, min(args.history))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


def main(argv=None) -> int:
    """Command line (`python -m tokenspeed.bench.kv`, same as `tokenspeed bench kv`)."""
    ap = argparse.ArgumentParser(prog="tokenspeed bench kv", description=__doc__.split("\n\n")[0])
    add_subcommands(ap.add_subparsers(dest="what", required=True))
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
