"""`tokenspeed bench profile`: where one decode step's CPU time goes (torch.profiler).

Prefills a short context, then profiles `steps` single-token decode steps of the model and
prints the op table (self CPU time) with the aten ops per token and the share of time spent in
the matmul kernels; the rest is per-op framework overhead (norms, rotary, views, cache writes).
"""
from __future__ import annotations

import torch

__all__ = ["profile_decode"]

_MATMULS = ("aten::mm", "aten::addmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu", "aten::linear")


def profile_decode(model: str | None = None, quantize: str | None = "int4", threads: int = 1, steps: int = 10,
                   context: int = 256, rows: int = 20) -> dict:
    """Profile `steps` decode steps after a `context`-token prefill; print the top `rows` ops.

    Args:
        model: as `Engine.load` (None: the embedded SmolLM2-135M; "tiny-random" for tests).
        quantize: None, "int8" or "int4".
        threads: torch intra-op threads.
    Returns:
        {"ops_per_token", "matmul_share" (0..1), "cpu_ms_per_token", "top": [(op, self CPU ms per token)]}.
    """
    from torch.profiler import ProfilerActivity, profile

    from ..session import Engine

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
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=rows))
    total = sum(k.self_cpu_time_total for k in ka)
    matmul = sum(k.self_cpu_time_total for k in ka if k.key in _MATMULS)
    top = sorted(((k.key, k.self_cpu_time_total / steps / 1e3) for k in ka), key=lambda x: -x[1])[:rows]
    res = {"ops_per_token": sum(k.count for k in ka) / steps, "matmul_share": matmul / total if total else 0.0,
           "cpu_ms_per_token": total / steps / 1e3, "top": top}
    print(f"# {res['ops_per_token']:.0f} aten ops per token, matmul kernels {100 * res['matmul_share']:.0f}% of "
          f"{res['cpu_ms_per_token']:.1f} ms self CPU per token ({quantize or 'fp32'}, {threads} threads)")
    return res
