"""`tokenspeed bench profile`: where one decode step's time goes (torch.profiler plus wall time).

Prefills a context, then times `steps` single-token decode steps of the model (wall clock,
median) and profiles them: the op table (self CPU time), ATen ops per token, and the time in the
ATen matmul kernels (int8 / GEMM) against the wall time. With the fused CPU decode step
(`tokenspeed.kernels.cpu_decode`) the layers - int4 matmuls, attention over the KV cache, norms,
rotary, SwiGLU - and the lm_head's int8 GEMV run in C++ code the profiler does not split (the
ATen matmul share is then ~0).
"""
from __future__ import annotations

import statistics
import time

import torch

__all__ = ["profile_decode"]

_MATMULS = ("aten::mm", "aten::addmm", "aten::_weight_int8pack_mm", "aten::linear")


def profile_decode(model: str | None = None, quantize: str | None = "auto", threads: int = 1, steps: int = 10,
                   context: int = 256, rows: int = 20) -> dict:
    """Time and profile `steps` decode steps after a `context`-token prefill; print the top `rows` ops.

    Args:
        model: as `Engine.load` (None: the embedded SmolLM2-135M; "tiny-random" for tests).
        quantize: "auto", None (fp32), "int8" or "int4".
        threads: torch intra-op threads.
        context: tokens in the KV cache before each timed step.
    Returns:
        {"wall_ms_per_token" (median), "ops_per_token", "matmul_ms_per_token" (self CPU of the
        matmul kernels), "matmul_share" (of the wall time, 0..1), "fused" (bool), "weights" (the
        format in force), "cpu_kernels" (the kernel variant),
        "top": [(op, self CPU ms per token)], "load_stages": `Engine.load_stages`}.
    """
    from torch.profiler import ProfilerActivity, profile

    from ..kernels.cpu_decode import selected_variant
    from ..engine import Engine

    engine = Engine.load(model, threads=threads, quantize=quantize)
    net = engine.model
    cache = net.new_cache(context + 8)
    net(torch.randint(0, engine.tokenizer.vocab_size, (context,)), torch.arange(context), cache, "none")
    token = torch.tensor([42])

    def step():
        cache.truncate(context)
        net(token, torch.tensor([context]), cache)

    for _ in range(3):
        step()
    wall = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        wall.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=rows))
    wall_ms = statistics.median(wall) * 1e3
    matmul = sum(k.self_cpu_time_total for k in ka if k.key in _MATMULS) / steps / 1e3
    top = sorted(((k.key, k.self_cpu_time_total / steps / 1e3) for k in ka), key=lambda x: -x[1])[:rows]
    res = {"wall_ms_per_token": wall_ms, "ops_per_token": sum(k.count for k in ka) / steps,
           "matmul_ms_per_token": matmul, "matmul_share": min(1.0, matmul / wall_ms), "fused": net.fused_decode() is not None,
           "top": top, "weights": engine.weights, "cpu_kernels": selected_variant(),
           "load_stages": dict(engine.load_stages)}
    print("# engine load stages (wall, CPU of the process):\n" + engine.load_stages.table())
    if engine.weight_choice is not None:
        print(f"# {engine.weight_choice.describe()}")
    print(f"# decode step at {context} tokens of context ({engine.weights}, {threads} threads, CPU kernels "
          f"{res['cpu_kernels']}, fused "
          f"{'on' if res['fused'] else 'off'}): {wall_ms:.1f} ms wall, {res['ops_per_token']:.0f} ATen ops; matmul "
          f"kernels {matmul:.1f} ms ({100 * res['matmul_share']:.0f}%), the rest {max(0.0, wall_ms - matmul):.1f} ms")
    return res
