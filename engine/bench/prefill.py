"""`tokenspeed bench prefill`: prefill cost against the context already cached, TokenSpeed vs llama.cpp.

The same token ids (seeded random ids of the embedded model's vocabulary; prefill cost does not
depend on which ids) are prefilled by TokenSpeed (default `quantize="auto"`, once per CPU kernel
variant) and by llama.cpp (llama-cpp-python, the same GGUF, in process), with the same threads:
for every prefix length P, P tokens are prefilled untimed, then N new tokens are timed (median of
`repeats`, the cache cut back to P between them). Each engine and thread count runs in its own
process. Beside each figure: the compute floor, the forward's matmul FLOPs (the N rows through the
block projections, the lm_head row) at this machine's int8 GEMM peak (`torch._int_mm`: oneDNN, AMX
where the CPU has it; the fp32 peak where that is faster) plus its attention FLOPs (over P + causal N, fp32) at the fp32 GEMM peak,
both measured with the same threads.

Run as a script (`python prefill.py worker ENGINE JOB OUT`) it is one engine's process: the
llama.cpp one imports no torch. Timings are `time.perf_counter()`; ms per new token.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PREFIXES = (0, 600, 2000)
NEW = (16, 84, 256)
QUICK_PREFIXES, QUICK_NEW = (0, 40), (8, 24)
GROWTH_BOUND = 1.2  # goal: ms/token after the longest prefix <= this x the same after none
PEER_BOUND = 0.5    # goal: TokenSpeed ms/token <= this x llama.cpp's, every cell


def _time_cells(prefill, cut, ids: list[int], prefixes, news, repeats: int) -> list[dict]:
    """Median wall ms (and process CPU ms per token: all threads, which other processes on a shared
    machine do not inflate) of prefill(ids[P:P + N], P) after prefill of ids[:P], per (P, N)."""
    cells = []
    for p in prefixes:
        cut(0)
        if p:
            prefill(ids[:p], 0)
            cut(p)  # a pruned cache: trimmed to its budget here, and this state kept for the cuts below
        for n in news:
            times, cpu = [], []
            for _ in range(repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                prefill(ids[p:p + n], p)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                cut(p)
            ms = statistics.median(times) * 1e3
            cells.append({"prefix": p, "new": n, "ms": ms, "ms_per_token": ms / n,
                          "cpu_ms_per_token": statistics.median(cpu) * 1e3 / n})
    return cells


def _worker_tokenspeed(job: dict, kv_budget: int | None) -> dict:
    import torch

    from tokenspeed import Engine
    from tokenspeed.kernels.cpu_decode import selected_variant
    from tokenspeed.kv import KVConfig, TieredKVCache

    engine = Engine.load(threads=job["threads"])
    model = engine.model
    dev = model.device
    if kv_budget is None:
        cache = model.new_cache(max(job["prefixes"]) + max(job["new"]) + 8)
        cut = cache.truncate
    else:  # the pruned hot set, as a session with kv_budget keeps it: trimmed to the budget after each prefill
        cache = TieredKVCache(model.args, KVConfig(budget=kv_budget), model.kv_dtype, dev)
        marks = {}

        def cut(n):
            if n == 0:
                cache.restore(0, cache.snapshot())
                cache.truncate(0)
            elif n in marks:
                cache.restore(n, marks[n])
            else:
                cache.trim()
                marks[n] = cache.snapshot()

    def prefill(ids, pos):
        for i in range(0, len(ids), 512):
            model(torch.tensor(ids[i:i + 512], dtype=torch.long, device=dev), pos + i, cache, "last")

    prefill(job["ids"][:8], 0)  # warm-up (extension load, first-touch of the weights)
    cells = _time_cells(prefill, cut, job["ids"], job["prefixes"], job["new"], job["repeats"])
    return {"engine": "tokenspeed", "weights": engine.weights, "cpu_kernels": selected_variant(),
            "kv_budget": kv_budget, "fused": model.fused_decode() is not None, "cells": cells}


def _worker_llamacpp(job: dict) -> dict:
    if os.environ.get("TOKENSPEED_LLAMA_CPP"):
        sys.path.insert(0, os.environ["TOKENSPEED_LLAMA_CPP"])
    import llama_cpp
    from llama_cpp import Llama

    n_batch = 512
    llm = Llama(model_path=job["model_gguf"], n_ctx=max(job["prefixes"]) + max(job["new"]) + 8,
                n_threads=job["threads"], n_threads_batch=job["threads"], n_batch=n_batch, n_ubatch=n_batch,
                seed=0, verbose=False)

    def prefill(ids, pos):
        llm.n_tokens = pos  # eval() drops the KV cache past n_tokens first
        llm.eval(ids)

    def cut(n):
        llm.n_tokens = n

    prefill(job["ids"][:8], 0)
    cells = _time_cells(prefill, cut, job["ids"], job["prefixes"], job["new"], job["repeats"])
    return {"engine": "llama.cpp", "weights": "GGUF (Q4_1)", "version": llama_cpp.__version__,
            "build": str(Path(llama_cpp.__file__).parent), "cpu_kernels": job.get("llama_kernels", "native"),
            "n_batch": n_batch, "cells": cells}


def worker(engine: str, job_path: str, out_path: str) -> None:
    """One engine's process: time its cells and write them to `out_path` (JSON). `engine`:
    "llama.cpp", "tokenspeed" or "tokenspeed:kv=B" (a pruned cache of budget B tokens)."""
    job = json.loads(Path(job_path).read_text())
    run = _worker_llamacpp(job) if engine == "llama.cpp" else _worker_tokenspeed(
        job, int(engine.split("=")[1]) if "=" in engine else None)
    Path(out_path).write_text(json.dumps(run))


def forward_flops(args, prefix: int, new: int) -> tuple[float, float]:
    """(matmul, attention) FLOPs of a forward of `new` tokens after `prefix` cached ones with logits
    for the last row: 2 per weight per row for the block projections plus the lm_head for one row;
    4 * head_dim per query head per visible slot (scores and weighted values)."""
    d, dh = args.dim, args.head_dim
    block = d * (args.n_heads + 2 * args.n_kv_heads) * dh + args.n_heads * dh * d + 3 * d * args.hidden_dim
    visible = new * prefix + new * (new + 1) / 2
    return (2.0 * new * block * args.n_layers + 2.0 * d * args.vocab_size,
            4.0 * dh * args.n_heads * args.n_layers * visible)


def measure_peaks(threads: int, size: int = 1024, repeats: int = 7) -> dict[str, float]:
    """GEMM throughput with `threads` torch threads, best of `repeats` size^3 products, in GOP/s:
    {"fp32": torch.mm, "int8": torch._int_mm, or the fp32 figure where this torch lacks it or it is
    slower (without AVX-512 VNNI or AMX it can be a reference loop: 0.4 GOP/s on a 2-core Zen 3,
    which made the floor 150x the measured time)}."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    peaks = {"fp32": 2.0 * size ** 3 / min(_timed(lambda: a @ b) for _ in range(repeats + 1)) / 1e9}
    try:
        qa, qb = (torch.randint(-127, 127, (size, size), dtype=torch.int8) for _ in range(2))
        peaks["int8"] = 2.0 * size ** 3 / min(_timed(lambda: torch._int_mm(qa, qb)) for _ in range(repeats + 1)) / 1e9
    except (AttributeError, RuntimeError):
        peaks["int8"] = peaks["fp32"]
    peaks["int8"] = max(peaks["int8"], peaks["fp32"])
    return peaks


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def run_prefill(out_dir: Path, quick: bool = False, threads: list[int] | None = None,
                variants: list[str] | None = None, repeats: int | None = None, kv_budget: int | None = 1024,
                llama_cpp_avx2: Path | None = None, timeout_s: float = 1800) -> dict:
    """Run every engine, write `report.json` in `out_dir` and return the report.

    Args:
        quick: prefixes 0 and 40, 8 and 24 new tokens, one repeat (the plumbing, for tests);
            a missing llama-cpp-python is then skipped with a note.
        threads: thread counts (default [1, 2]). variants: CPU kernel variants of TokenSpeed
            (default: this CPU's best and, where it differs, "avx2").
        repeats: timed repeats per cell (default 3; quick 1).
        kv_budget: also run TokenSpeed (first variant) with a pruned cache of this hot-set budget
            (the agent's default, 1024), trimmed after the prefix as a session trims after observe();
            None: not.
        llama_cpp_avx2: a `pip install --target` folder holding an AVX2 build of llama-cpp-python
            (`make peers-avx2`): also run it, and compare TokenSpeed's AVX2 variants with it.
    Raises:
        RuntimeError: an engine process failed (its stderr tail is in the message), or
            llama-cpp-python is missing in a full run.
        ValueError: a variant this CPU cannot run.
    """
    import importlib.util

    from ..kernels.cpu_decode import ISA_ENV, VARIANTS, native_variant, selected_variant
    from ..weights import default_model_path, resolve_model

    threads = threads or [1, 2]
    native = native_variant()
    variants = variants or ([native] + (["avx2"] if native != "avx2" and native in
                                        ("avx512", "avx2-vnni") else []))
    env0 = {k: v for k, v in os.environ.items() if k != ISA_ENV}
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"unknown CPU kernel variant {v!r}; choose from {', '.join(VARIANTS)}")
        os.environ[ISA_ENV] = v
        try:
            selected_variant()  # raises for a variant this CPU cannot run
        finally:
            os.environ.pop(ISA_ENV)
    notes = []
    have_llama = bool(os.environ.get("TOKENSPEED_LLAMA_CPP")) or importlib.util.find_spec("llama_cpp") is not None
    if not have_llama:
        if not quick:
            raise RuntimeError("tokenspeed bench prefill needs llama-cpp-python (make peers)")
        notes.append("llama.cpp skipped: llama-cpp-python is not installed (make peers)")
    prefixes, news = (QUICK_PREFIXES, QUICK_NEW) if quick else (PREFIXES, NEW)
    repeats = repeats or (1 if quick else 3)
    files = resolve_model(None)
    import random

    rng = random.Random(0)
    ids = [rng.randrange(100, files.args.vocab_size) for _ in range(max(prefixes) + max(news))]
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for th in threads:
        job = {"threads": th, "prefixes": list(prefixes), "new": list(news), "repeats": repeats, "ids": ids,
               "model_gguf": str(default_model_path())}
        job_path = out_dir / f"job-{th}.json"
        job_path.write_text(json.dumps(job))
        engines = ([("tokenspeed", v) for v in variants] + [(f"tokenspeed:kv={kv_budget}", variants[0])] * bool(kv_budget)
                   + [("llama.cpp", None)] * have_llama + [("llama.cpp", "avx2")] * bool(llama_cpp_avx2))
        for name, variant in engines:
            out = out_dir / f"run-{name.replace(':', '-')}-{variant or 'native'}-{th}.json"
            env, run_job = dict(env0, OMP_NUM_THREADS=str(th)), job_path
            if name == "llama.cpp" and variant:
                env["TOKENSPEED_LLAMA_CPP"] = str(llama_cpp_avx2)
                run_job = out_dir / f"job-{th}-avx2.json"
                run_job.write_text(json.dumps(job | {"llama_kernels": "avx2"}))
            elif variant:
                env[ISA_ENV] = variant
            print(f"# {name} {variant or ''} threads {th} ...", file=sys.stderr, flush=True)
            proc = subprocess.run([sys.executable, __file__, "worker", name, str(run_job), str(out)], env=env,
                                  capture_output=True, text=True, timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"{name} {variant or ''} (threads {th}) failed (exit {proc.returncode}):\n"
                                   f"{proc.stderr[-3000:]}")
            runs.append(json.loads(out.read_text()) | {"threads": th})
    peaks = {th: measure_peaks(th) for th in threads}
    report = make_report(runs, peaks, files.args, notes, quick)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    return report


def make_report(runs: list[dict], peaks: dict[int, dict[str, float]], args, notes: list[str], quick: bool) -> dict:
    """Rows per (engine, variant, threads) with each cell's floor, ratio to llama.cpp (same threads;
    TokenSpeed's avx2 variants against llama.cpp's AVX2 build when it ran) and growth (ms/token after the longest prefix over after none, per N), and the goals."""
    peer = {(r["threads"], r["cpu_kernels"], c["prefix"], c["new"]): c["ms_per_token"] for r in runs
            if r["engine"] == "llama.cpp" for c in r["cells"]}
    rows = []
    for r in runs:
        cells = []
        for c in r["cells"]:
            mm, att = forward_flops(args, c["prefix"], c["new"])
            peak = peaks[r["threads"]]
            floor = (mm / peak["int8"] + att / peak["fp32"]) / 1e9 * 1e3 / c["new"]
            family = "avx2" if r.get("cpu_kernels", "").startswith("avx2") else "native"
            theirs = peer.get((r["threads"], family, c["prefix"], c["new"]), peer.get((r["threads"], "native", c["prefix"], c["new"])))
            cells.append(c | {"floor_ms_per_token": floor,
                              "vs_llama_cpp": c["ms_per_token"] / theirs if theirs and r["engine"] != "llama.cpp" else None})
        by = {(c["prefix"], c["new"]): c["ms_per_token"] for c in cells}
        longest = max(c["prefix"] for c in cells)
        growth = {n: by[(longest, n)] / by[(0, n)] for (p, n) in by if p == 0}
        rows.append({k: v for k, v in r.items() if k != "cells"} | {"cells": cells, "growth": growth})
    ours = [r for r in rows if r["engine"] == "tokenspeed"]
    ratios = [c["vs_llama_cpp"] for r in ours for c in r["cells"] if c["vs_llama_cpp"] is not None]
    goals = {
        f"ms/token after the longest prefix <= {GROWTH_BOUND}x after none": all(
            g <= GROWTH_BOUND for r in ours for g in r["growth"].values()),
        f"<= {PEER_BOUND}x llama.cpp everywhere": bool(ratios) and max(ratios) <= PEER_BOUND,
    }
    return {"command": "tokenspeed bench prefill" + (" --quick" if quick else ""),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "load_avg": os.getloadavg(), "peak_gops": peaks},
            "rows": rows, "goals": goals, "notes": notes}


def print_table(report: dict) -> None:
    """The report as one table: a row per (engine, kernels, threads), a column per (prefix, N)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=220)
    rows = report["rows"]
    keys = [(c["prefix"], c["new"]) for c in rows[0]["cells"]]
    peaks = ", ".join(f"{th} thr fp32 {g['fp32']:.0f} int8 {g['int8']:.0f}" for th, g in report["machine"]["peak_gops"].items())
    t = Table(title=f"prefill ms/token (x llama.cpp, same threads) [floor]; GEMM peaks GOP/s: {peaks}; "
                    f"load avg {report['machine']['load_avg'][0]:.1f}")
    t.add_column("engine")
    t.add_column("thr", justify="right")
    for p, n in keys:
        t.add_column(f"P={p} N={n}", justify="right")
    t.add_column("growth", justify="right")
    for r in rows:
        name = r["engine"] + (f" {r['weights']} {r['cpu_kernels']}" if r["engine"] == "tokenspeed" else
                              f" ({r['cpu_kernels']} build)") \
            + (f" kv_budget={r['kv_budget']}" if r.get("kv_budget") else "")
        cells = [f"{c['ms_per_token']:.2f}" + (f" ({c['vs_llama_cpp']:.2f}x)" if c["vs_llama_cpp"] else "")
                 + f" [{c['floor_ms_per_token']:.2f}]" for c in r["cells"]]
        t.add_row(name, str(r["threads"]), *cells, " ".join(f"{g:.2f}" for g in r["growth"].values()))
    console.print(t)
    for goal, met in report["goals"].items():
        console.print(f"goal {goal}: {'met' if met else 'NOT met'}")
    for note in report["notes"]:
        console.print(f"note: {note}")


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    worker(*sys.argv[2:])
