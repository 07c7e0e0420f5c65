"""`tokenspeed bench gpu`: prefill TTFT and decode ITL on CUDA against the memory-bandwidth floor.

Two models, the same code path as the CPU engine (`Transformer.forward` on a `KVCache`):
- a Llama-3.1-8B-shaped decoder (32 layers, dim 4096, GQA 32/8, SwiGLU 14336, vocab 128256,
  Llama-3.1 RoPE scaling) with random bf16 weights (no download: initialised on the device);
- the embedded SmolLM2-135M (real weights), bf16.
For each, at a short and a long context: TTFT = prefill of the prompt + first token, ITL = one
decode step (synchronised, as an engine that reads each token on the host does), next to the
floor = (weight bytes + KV bytes read per step) / measured bandwidth (a device-wide sum over a
large tensor). One H200 run takes well under 8 minutes (most of it the 16 GB weight init).

On CPU (`--device cpu`, or no GPU) the 8B shape is replaced by a small one (`--quick` smaller
still), so tests run the same script.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from ..model import ModelArgs, Transformer

__all__ = ["LLAMA31_8B", "SMALL", "TINY", "device_bandwidth", "random_model", "measure", "run_gpu"]

LLAMA31_8B = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=14336,
                       vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       max_seq_len=8192, tie_embeddings=False)
SMALL = ModelArgs(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=64, hidden_dim=2816,
                  vocab_size=32768, max_seq_len=4096, tie_embeddings=False)
TINY = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256,
                 vocab_size=1024, max_seq_len=512, tie_embeddings=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_bandwidth(device: torch.device, mib: int = 2048, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: median time of `x.sum()` over `mib` MiB (bf16 on CUDA, fp32 on CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.ones(mib * 2**20 // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
    x.sum()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return x.numel() * x.element_size() / statistics.median(times) / 1e9


def random_model(args: ModelArgs, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """A `Transformer` with random weights (N(0, 0.02), norms 1) created directly on `device`."""
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.to(dtype=dtype).eval()


def _weight_bytes(model: Transformer) -> int:
    # Every projection (lm_head included, once) - what a decode step reads; embeddings are gathered.
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            total += m.weight.numel() * m.weight.element_size()
    return total


def measure(model: Transformer, context: int, decode_tokens: int, device: torch.device, bandwidth_gbs: float) -> dict:
    """TTFT (prefill of `context` random tokens + first token) and ITL p50/p90 of `decode_tokens` steps.

    Returns a dict in ms with the floors: floor_ms (weights) and floor_ctx_ms (weights + KV read).
    """
    args = model.args
    cache = model.new_cache(context + decode_tokens + 1)
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, args.vocab_size, (context,), generator=gen).to(device)
    warm = model.new_cache(64)
    for n in (16, 1, 1):  # warm-up: kernels, allocator
        model(prompt[:n], torch.arange(warm.n, warm.n + n, device=device), warm)
    _sync(device)
    t0 = time.perf_counter()
    token = model(prompt, torch.arange(context, device=device), cache).argmax(-1)
    _sync(device)
    ttft = time.perf_counter() - t0
    itl = []
    for _ in range(decode_tokens):
        t0 = time.perf_counter()
        pos = torch.tensor([cache.n], device=device)
        token = model(token.view(1), pos, cache).argmax(-1)
        _sync(device)
        itl.append(time.perf_counter() - t0)
    itl.sort()
    wbytes = _weight_bytes(model)
    kv_bytes = 2 * args.n_layers * args.n_kv_heads * args.head_dim * (context + decode_tokens // 2) * cache.k.element_size()
    return {"context": context, "ttft_ms": ttft * 1e3, "prefill_tok_s": context / ttft,
            "itl_p50_ms": itl[len(itl) // 2] * 1e3, "itl_p90_ms": itl[int(len(itl) * 0.9)] * 1e3,
            "floor_ms": wbytes / (bandwidth_gbs * 1e9) * 1e3,
            "floor_ctx_ms": (wbytes + kv_bytes) / (bandwidth_gbs * 1e9) * 1e3,
            "weight_gb": wbytes / 1e9}


def run_gpu(device: str | None = None, quick: bool = False, out: Path | None = None) -> dict:
    """Run both models at a short and a long context and print the table; returns the results.

    Args:
        device: "cuda", "cpu" or None (cuda when available).
        quick: tiny shapes, short contexts, few decode steps (CPU tests).
        out: write the results as JSON here (optional).
    Raises:
        ValueError: device "cuda" asked for but not available.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        big, contexts, steps, name = LLAMA31_8B, (128, 4096), 64, "llama-3.1-8b-shape (random)"
    elif quick:
        big, contexts, steps, name = TINY, (16, 64), 8, "tiny-shape (random)"
    else:
        big, contexts, steps, name = SMALL, (128, 1024), 32, "small-shape (random)"
    bw = device_bandwidth(dev, mib=2048 if cuda else (64 if quick else 256))
    results = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "dtype": str(dtype),
               "bandwidth_gbs": bw, "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": []}
    t0 = time.perf_counter()
    model = random_model(big, dev, dtype)
    init_s = time.perf_counter() - t0
    for c in contexts:
        results["rows"].append({"model": name, "init_s": init_s, **measure(model, c, steps, dev, bw)})
    del model
    if cuda:
        torch.cuda.empty_cache()
    from ..session import Engine

    engine = Engine.load("tiny-random" if quick else None, device=str(dev), dtype=dtype)
    for c in contexts:
        results["rows"].append({"model": f"smollm2-135m ({engine.source})", "init_s": engine.load_s,
                                **measure(engine.model, c, steps, dev, bw)})
    if cuda:
        results["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
    _print(results)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    return results


def _print(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"decode vs floor on {results['device']} ({results['dtype']}), "
                    f"measured bandwidth {results['bandwidth_gbs']:.0f} GB/s")
    for col in ("model", "context", "TTFT ms", "prefill tok/s", "ITL p50 ms", "ITL p90 ms", "floor ms",
                "floor+KV ms", "ITL / floor"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in results["rows"]:
        t.add_row(r["model"], str(r["context"]), f"{r['ttft_ms']:.1f}", f"{r['prefill_tok_s']:.0f}",
                  f"{r['itl_p50_ms']:.2f}", f"{r['itl_p90_ms']:.2f}", f"{r['floor_ms']:.2f}",
                  f"{r['floor_ctx_ms']:.2f}", f"{r['itl_p50_ms'] / r['floor_ctx_ms']:.1f}x")
    Console(width=160).print(t)
