"""GPU timing of decode attention with slot mass: Triton kernel vs the torch path vs plain SDPA.

    python -m tokenspeed.bench.gpu_attention [--json out.json] [--session]

Checks the Triton kernel against the torch path on the GPU first (raises AssertionError on a
mismatch), then times one decode step (T = 1) at several hot-tier sizes for the SmolLM2-135M
head layout (9 query / 3 KV heads, D 64) and a Llama-3.1-8B layout (32 / 8, D 128), in fp16
and fp32. With --session it also runs the pruned-cache cost benchmark
(`tokenspeed.bench.kv.cost`) on CUDA. Times are CUDA-event medians in microseconds.
Needs CUDA and triton; prints what is missing otherwise (exit code 2).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F


def _time_us(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tokenspeed.bench.gpu_attention")
    ap.add_argument("--json", default=None)
    ap.add_argument("--session", action="store_true", help="also time pruned-cache decisions on CUDA")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    try:
        from ..kernels.triton_decode import decode_attention_with_mass
    except ImportError as exc:
        print(f"triton missing: {exc}", file=sys.stderr)
        return 2
    from ..kernels.attention import attention_with_mass

    rows = []
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| layout | dtype | slots | triton us | torch-mass us | sdpa (no mass) us | max err |\n|---|---|---|---|---|---|---|")
    for name, H, Hkv, D in (("smollm2-135m", 9, 3, 64), ("llama-3.1-8b", 32, 8, 128)):
        for dtype in (torch.float16, torch.float32):
            for S in (512, 1024, 2048, 8192):
                q = torch.randn(1, H, 1, D, device="cuda", dtype=dtype)
                k = torch.randn(1, Hkv, S, D, device="cuda", dtype=dtype)
                v = torch.randn(1, Hkv, S, D, device="cuda", dtype=dtype)
                out, mass, lse = decode_attention_with_mass(q, k, v)
                ref_out, ref_mass, _ = attention_with_mass(q, k, v, None)
                err = max(float((out.float() - ref_out.float()).abs().max()), float((mass - ref_mass).abs().max()))
                assert err < (2e-2 if dtype == torch.float16 else 1e-4), f"{name} {dtype} S={S}: error {err}"
                row = dict(layout=name, dtype=str(dtype).split(".")[-1], slots=S,
                           triton_us=_time_us(lambda: decode_attention_with_mass(q, k, v)),
                           torch_mass_us=_time_us(lambda: attention_with_mass(q, k, v, None)),
                           sdpa_us=_time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
                           max_err=err)
                rows.append(row)
                print(f"| {name} | {row['dtype']} | {S} | {row['triton_us']:.1f} | {row['torch_mass_us']:.1f} | "
                      f"{row['sdpa_us']:.1f} | {err:.1e} |", flush=True)
    if args.session:
        from .. import Engine
        from .kv import cost

        engine = Engine.load(device="cuda")
        rows += cost(engine, histories=(1024, 4096, 16384), budget=1024, decisions=3, full_upto=4096)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
