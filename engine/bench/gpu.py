"""`tokenspeed bench gpu --out DIR`: the one device check of the GPU engine, in one call.

Sections, in order (each writes its part of DIR/gpu.json as soon as it ends, so a run stopped at
its time limit still leaves what it measured; a section that raises is recorded with its error
and the run goes on):

1. bandwidth: device read bandwidth (median `x.sum()` over a large tensor), the floor's divisor.
2. kernels: the Triton decode-attention kernel (values against torch SDPA; slot mass and
   log-sum-exp against the torch path; GQA, 1 and 4 rows with verification's mask) and the fused
   RMSNorm(+residual) kernel against torch; on CUDA also their CUDA-event median times.
3. raw decode: one decode step (prefill TTFT too) of a Llama-3.1-8B-shaped random bf16 model and
   of the embedded model against the floor = (weight bytes + KV bytes read) / bandwidth, over a full
   KV cache at a short and a long context (eager, and as CUDA graph replays) and over a pruned one (1024-token budget: the Triton
   attention with slot mass) at the long one, with the torch norms and with the fused Triton norm
   (`Transformer.use_triton_norm`, off by default until these figures say it helps); then the graph
   step with weight-only int8 and int4 weights (`tokenspeed.quant`: torch's kernels on CUDA), whose
   floor counts their own bytes: the rows that say whether they beat bf16.
4. parity: greedy decoding of the device model (bf16 on CUDA) against the CPU fp32 reference on
   20 BFCL prompts (`$TOKENSPEED_BFCL`): the device model, fed the reference's tokens, must choose
   every one of them (so its greedy decode is identical), and each logits row must be within
   `PARITY_RTOL` (relative L2) of the reference's.
5. agent: through the public Session API, for the embedded model and for the 8B-shaped body with
   the embedded model's vocabulary (random weights: timings only): the 10-call AAL turn of
   `tokenspeed bench aal` (warm session, jump-forward and speculation on), its effective ITL on
   tool calls ((decide time - TTFT) / (output tokens - 1): forced and accepted tokens included),
   then warm `decide()` TTFT with a ~4K-token context already cached; the embedded model's figures
   once more without pipelined drafting (`Engine.pipeline`), the A/B of the overlap.
6. profile: one more warm `decide()` of each of those engines under `torch.profiler` (CPU and CUDA
   activity): how long the GPU sat idle between the kernels of its decode steps (busy, span, idle
   fraction, gap p50/p90/max, the largest gaps with the kernels on either side: where the host
   stalled the GPU). On a CPU the profile holds no device kernels and says so.

The figures are printed next to the product brief's column (TokenSpeed / vLLM / TensorRT-LLM, one
H100, 7B) and the goals. On CPU (`--device cpu --quick`) the same script runs with small shapes
(tests); the Triton checks run there only under `TRITON_INTERPRET=1`.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from ..device import DecodeGraphs
from ..kv import KVConfig, TieredKVCache
from ..model import ModelArgs, Transformer
from ..quant import MODES, linear_bytes, quantize
from .kernel_gaps import device_kernels, kernel_gaps

__all__ = ["LLAMA31_8B", "SMALL", "TINY", "BRIEF", "GOALS", "PARITY_RTOL", "device_bandwidth", "random_model",
           "measure", "check_kernels", "check_parity", "agent_figures", "profile_decision",
           "run_gpu"]

LLAMA31_8B = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=14336,
                       vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       max_seq_len=8192, tie_embeddings=False)
SMALL = ModelArgs(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=64, hidden_dim=2816,
                  vocab_size=32768, max_seq_len=4096, tie_embeddings=False)
TINY = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256,
                 vocab_size=1024, max_seq_len=2048, tie_embeddings=False)
# The product brief's column (ARCHITECTURE.md, "Performance model"): one H100, a 7B Llama-3.1 model,
# 10 function calls over a 4K-token context. ms: (TokenSpeed as briefed, vLLM 0.6.0, TensorRT-LLM 0.11).
BRIEF = {"ttft_ms": (8.2, 45.1, 38.7), "itl_ms": (3.1, 12.4, 10.8), "turn_ms": (112.0, 487.0, 423.0)}
# The goals: raw decode step / HBM floor (8B, bf16), warm decision TTFT (ms), effective ITL (ms).
GOALS = {"decode_vs_floor": 1.15, "ttft_ms": 5.0, "itl_ms": 1.5}
# bf16 weights and activations against fp32 over 30 layers: relative L2 error of a logits row.
PARITY_RTOL = 3e-2
PARITY_PROMPTS = 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_us(fn, device: torch.device, iters: int = 50) -> float:
    # CUDA-event median of fn() in microseconds, after warm-up (compilation, allocator).
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize(device)
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def device_bandwidth(device: torch.device, mib: int = 2048, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: median time of `x.sum()` over `mib` MiB (bf16 on CUDA, fp32 on CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.rand(mib * 2**20 // torch.finfo(dtype).bits * 8, device=device).to(dtype)  # not zeros
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


# ---------------------------------------------------------------------------------- kernels

def _verify_mask(T: int, S: int, device) -> torch.Tensor:
    # As Transformer.forward builds it: cached slots visible, causal among the T new rows.
    mask = torch.ones(T, S, dtype=torch.bool, device=device)
    mask[:, S - T:] = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return mask


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def check_kernels(device: torch.device, quick: bool = False) -> dict:
    """Triton attention and fused norm against torch (errors, pass/fail) and, on CUDA, their times.

    Attention rows: layout (heads/KV heads/D of SmolLM2-135M and Llama-3.1-8B), dtype, slots S, query
    rows T (T > 1 with verification's mask); out_rel (relative L2 vs SDPA), mass_rel, lse_err (max
    abs vs the torch path); on CUDA triton_us / torch_mass_us / sdpa_us. Norm rows: dim, rows,
    residual, y_rel; on CUDA fused_us / torch_us. Tolerances: fp32 1e-4; bf16 inputs 1e-2.
    Returns {"attention": [...], "norm": [...], "ok": bool}, or {"skipped": why} on a CPU without
    `TRITON_INTERPRET=1` (the interpreter must be chosen before Triton is imported).
    """
    cuda = device.type == "cuda"
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "Triton runs on CPU tensors only under TRITON_INTERPRET=1"}
    from ..kernels.attention import attention_with_mass
    from ..kernels.norm import add_rms_norm
    from ..kernels.triton_decode import decode_attention_with_mass
    from ..kernels.triton_norm import triton_add_rms_norm

    dtype = torch.bfloat16 if cuda else torch.float32
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    gen = torch.Generator(device=device).manual_seed(1)
    attention, norm, ok = [], [], True
    layouts = [("smollm2-135m", 9, 3, 64), ("llama-3.1-8b", 32, 8, 128)]
    for name, H, Hkv, D in layouts[:1] if quick else layouts:
        for S in (70,) if quick else (500, 4099):  # not multiples of the tiles or splits
            for T in (1, 4):
                q = torch.randn(1, H, T, D, device=device, generator=gen).to(dtype)
                k = torch.randn(1, Hkv, S, D, device=device, generator=gen).to(dtype)
                v = torch.randn(1, Hkv, S, D, device=device, generator=gen).to(dtype)
                mask = _verify_mask(T, S, device) if T > 1 else None
                out, mass, lse = decode_attention_with_mass(q, k, v, mask)
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                _, ref_mass, ref_lse = attention_with_mass(q, k, v, mask)
                row = dict(layout=name, dtype=str(dtype).removeprefix("torch."), slots=S, rows=T,
                           out_rel=_rel(out, ref), mass_rel=_rel(mass, ref_mass),
                           lse_err=float((lse - ref_lse).abs().max()))
                row["ok"] = row["out_rel"] < tol and row["mass_rel"] < tol and row["lse_err"] < 10 * tol
                if cuda:
                    row.update(triton_us=_median_us(lambda: decode_attention_with_mass(q, k, v, mask), device),
                               torch_mass_us=_median_us(lambda: attention_with_mass(q, k, v, mask), device),
                               sdpa_us=_median_us(lambda: F.scaled_dot_product_attention(
                                   q, k, v, attn_mask=mask, enable_gqa=True), device))
                ok &= row["ok"]
                attention.append(row)
    for dim in (576,) if quick else (576, 4096):
        for rows in (1, 4):
            for residual in (False, True):
                h = torch.randn(1, rows, dim, device=device, generator=gen).to(dtype)
                delta = torch.randn(1, rows, dim, device=device, generator=gen).to(dtype) if residual else None
                w = (1 + 0.1 * torch.randn(dim, device=device, generator=gen)).to(dtype)
                _, y = triton_add_rms_norm(h, delta, w, 1e-5)
                _, ref_y = add_rms_norm(h, delta, w, 1e-5)
                row = dict(dim=dim, rows=rows, residual=residual, y_rel=_rel(y, ref_y))
                row["ok"] = row["y_rel"] < tol
                if cuda:
                    row.update(fused_us=_median_us(lambda: triton_add_rms_norm(h, delta, w, 1e-5), device),
                               torch_us=_median_us(lambda: add_rms_norm(h, delta, w, 1e-5), device))
                ok &= row["ok"]
                norm.append(row)
    return {"attention": attention, "norm": norm, "ok": bool(ok)}


# ---------------------------------------------------------------------------------- raw decode

def measure(model: Transformer, context: int, decode_tokens: int, device: torch.device, bandwidth_gbs: float,
            kv: KVConfig | None = None, graphs: bool = False) -> dict:
    """TTFT (prefill of `context` random tokens + first token) and ITL p50/p90 of `decode_tokens`
    decode steps (synchronised each step, as an engine that reads each token on the host does).

    graphs: run the decode steps through `tokenspeed.device.DecodeGraphs` (full cache only): CUDA
    graph replays on CUDA, the same static step eagerly elsewhere; else the model's own forward.

    kv: None for a full KV cache; a `KVConfig` for a pruned one (`TieredKVCache`, whose attention
    also scores relevance: the Triton kernel on CUDA). Its prefill runs in chunks of 512 tokens (at
    most `kv.reserve`), trimmed to the budget after each (as `Session.observe` does), and its decode steps inside
    `cache.decision()` (no prefetch, as in a decision).
    Returns a dict in ms with the floors: floor_ms (weights) and floor_ctx_ms (weights + the KV
    read at the middle step), itl_vs_floor = ITL p50 / floor_ctx_ms, and attended (slots read then).
    """
    args = model.args
    if kv is None:
        cache, chunk = model.new_cache(context + decode_tokens + 3), context
    else:
        cache, chunk = TieredKVCache(args, kv, model.kv_dtype, model.device), min(512, kv.reserve)
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, args.vocab_size, (context,), generator=gen).to(device)
    warm = model.new_cache(64)
    for n in (16, 1, 1):  # warm-up: kernels, allocator
        model(prompt[:n], warm.n, warm)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(0, context, chunk):
        last = i + chunk >= context
        logits = model(prompt[i:i + chunk], i, cache, "last" if last else "none")
        cache.trim()
    token = logits.argmax(-1)
    _sync(device)
    ttft = time.perf_counter() - t0
    itl, attended = [], 0
    runner = DecodeGraphs(model, cache) if graphs and kv is None else None
    with cache.decision():
        for step in range(decode_tokens + 2):  # the first two warm this cache's kernels (and capture graphs) up: not timed
            t0 = time.perf_counter()
            if runner is not None:
                token = model.output(runner.run([int(token)], context + step)).argmax(-1)
            else:
                token = model(token.view(1), context + step, cache).argmax(-1)  # an int start: no device read
            _sync(device)
            itl.append(time.perf_counter() - t0)
            if step == 2 + decode_tokens // 2:
                attended = cache.n
    itl = sorted(itl[2:])
    wbytes = linear_bytes(model)
    kv_bytes = 2 * args.n_layers * args.n_kv_heads * args.head_dim * attended * cache.k.element_size()
    floor_ctx = (wbytes + kv_bytes) / (bandwidth_gbs * 1e9) * 1e3
    p50 = itl[len(itl) // 2] * 1e3
    return {"context": context, "cache": "full" if kv is None else f"pruned {kv.budget}", "attended": attended,
            "step": "graph" if runner is not None else "eager",
            "ttft_ms": ttft * 1e3, "prefill_tok_s": context / ttft,
            "itl_p50_ms": p50, "itl_p90_ms": itl[int(len(itl) * 0.9)] * 1e3,
            "floor_ms": wbytes / (bandwidth_gbs * 1e9) * 1e3, "floor_ctx_ms": floor_ctx,
            "itl_vs_floor": p50 / floor_ctx, "weight_gb": wbytes / 1e9}


def _raw_decode(name: str, model: Transformer, contexts, steps: int, device: torch.device, bw: float,
                pruned: KVConfig) -> list[dict]:
    # The decode step at each context over a full cache, eager and as CUDA graph replays (on the CPU
    # the graph runner's static step, eagerly), and at the longest over a `pruned` cache (eager: the
    # Triton attention on CUDA), with the torch norms and (on CUDA) the fused Triton norm; then the
    # graph step of a weight-only int8 and int4 copy (torch's kernels on CUDA), each context.
    rows, plain = [], str(model.dtype).removeprefix("torch.")
    for fused_norm in (False, True) if device.type == "cuda" else (False,):
        model.use_triton_norm = fused_norm
        try:
            for c, kv, graphs in ([(c, None, g) for c in contexts for g in (False, True)]
                                  + [(contexts[-1], pruned, False)]):
                rows.append({"model": name, "weights": plain, "triton_norm": fused_norm,
                             **measure(model, c, steps, device, bw, kv, graphs)})
        finally:
            del model.use_triton_norm  # back to the class default
    for mode in MODES:
        model.invalidate_fused()  # the fused CPU step holds the C++ extension, which does not copy
        q = quantize(copy.deepcopy(model), mode)
        try:
            rows += [{"model": name, "weights": mode, "triton_norm": False, **measure(q, c, steps, device, bw, graphs=True)}
                     for c in contexts]
        finally:
            del q
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------- parity

def parity_prompts(tok, n: int = PARITY_PROMPTS, bfcl: str | None = None) -> list[list[int]]:
    """Token ids of the first `n` held-out BFCL prompts with their tools in the system prompt, chat-rendered."""
    from ..bfcl import bfcl_dir, load_bfcl
    from ..grammar import normalize_tools, tools_system_prompt

    out = []
    for case in load_bfcl("heldout", path=bfcl_dir(bfcl))[:n]:
        system = tools_system_prompt("You are a function-calling assistant.", normalize_tools(case["tools"]))
        messages = [{"role": "system", "content": system}] + case["messages"]
        out.append(tok.encode(tok.render_chat(messages, add_generation_prompt=True)))
    return out


def check_parity(ref: Transformer, dev: Transformer, prompts: list[list[int]], new_tokens: int,
                 rtol: float = PARITY_RTOL) -> dict:
    """Greedy parity of `dev` (any device/dtype) against the CPU fp32 `ref` (same weights).

    The reference decodes `new_tokens` greedily, one token per forward; `dev` runs one forward over
    the prompt and those tokens and must choose each of them at every position (then its own greedy
    decode is the same sequence). Returns counts, the largest relative L2 logits error, the
    mismatches (prompt, step, the reference's top-2 margin) and ok.
    """
    device = dev.device
    tokens = identical = 0
    worst, mismatches = 0.0, []
    for i, ids in enumerate(prompts):
        cache = ref.new_cache(len(ids) + new_tokens + 1)
        logits = ref(torch.tensor(ids), torch.arange(len(ids)), cache, "last")[0]
        out, ref_rows = [], []
        for _ in range(new_tokens):
            ref_rows.append(logits)
            out.append(int(logits.argmax()))
            logits = ref(torch.tensor(out[-1:]), torch.tensor([cache.n]), cache, "last")[0]
        seq = torch.tensor(ids + out[:-1], device=device)
        rows = dev(seq, torch.arange(len(seq), device=device), dev.new_cache(len(seq)), "all")[len(ids) - 1:].float().cpu()
        ref_rows = torch.stack(ref_rows)
        chosen = rows.argmax(-1)
        same = chosen == torch.tensor(out)
        tokens += len(out)
        identical += int(same.sum())
        worst = max(worst, max(_rel(r, q) for r, q in zip(rows, ref_rows)))
        for step in (~same).nonzero().flatten().tolist():
            top2 = ref_rows[step].topk(2).values
            mismatches.append({"prompt": i, "step": step, "ref_margin": float(top2[0] - top2[1])})
    return {"prompts": len(prompts), "tokens": tokens, "identical_tokens": identical, "max_rel_logit_err": worst,
            "rtol": rtol, "mismatches": mismatches, "ok": identical == tokens and worst <= rtol}


# ---------------------------------------------------------------------------------- agent

def _run_turn(engine, wl) -> tuple[object, list[dict]]:
    # The AAL turn in a new session: observe each turn's observations, then decide (as bench aal).
    session = engine.session(system=wl.system, tools=wl.tools)
    records = []
    for turn in wl.turns:
        t0 = time.perf_counter()
        for o in turn.observations:
            session.observe(o.content, role=o.role, kind=o.kind, source=o.source)
        t1 = time.perf_counter()
        d = session.decide(tool_choice=turn.tool_choice, max_tokens=wl.max_tokens)
        t2 = time.perf_counter()
        n_out = d.forced_tokens + d.generated_tokens
        records.append({"status": d.status, "context_tokens": session.num_tokens, "ttft_ms": d.ttft_s * 1e3,
                        "decide_ms": (t2 - t1) * 1e3, "turn_ms": (t2 - t0) * 1e3, "output_tokens": n_out,
                        "forced_tokens": d.forced_tokens, "forwards": d.forwards, "draft_tokens": d.draft_tokens,
                        "accepted_tokens": d.accepted_tokens, "drafted_ahead": d.drafted_ahead,
                        "after_first_ms": (d.total_s - d.ttft_s) * 1e3})
    return session, records


def _fill(session, context: int) -> None:
    # Sensor readings until the session holds `context` tokens.
    i = 0
    while session.num_tokens < context:
        i += 1
        session.observe(f"[joint_states] t={i * 0.1:.1f} q=[{', '.join(f'{math.sin(i + j):.3f}' for j in range(7))}] "
                        f"gripper={'open' if i % 2 else 'closed'}", kind="sensor", source="joint_states")


_DECIDE = "tokenspeed.decide"  # the profiler range of a warm decide() call


def _warm_decision(session, wl):
    # One decision on the workload's first request (observed, decided, then rolled back); its
    # decide() call is the profiler range _DECIDE (a no-op without a profiler).
    from torch.profiler import record_function

    request = wl.turns[0]
    cp = session.checkpoint()
    session.observe(request.observations[-1].content, source="operator")
    with record_function(_DECIDE):
        d = session.decide(tool_choice=request.tool_choice, max_tokens=wl.max_tokens)
    session.rollback(cp)
    return d


def agent_figures(engine, wl, context: int, repeats: int = 5) -> dict:
    """The AAL turn, effective ITL on its tool calls, and warm decide() TTFT at `context` cached tokens.

    One untimed turn first (grammar compilation, kernels, allocator), then the timed turn in a new
    session. That session is then filled with sensor readings to `context` tokens (if it holds
    fewer) and decides `repeats` times on one short request (each rolled back), timing TTFT.
    Returns ms figures: turn_ms, ttft_p50_ms (turn), itl_eff_ms, warm_ttft_p50_ms, with the records.
    """
    _run_turn(engine, wl)
    t0 = time.perf_counter()
    session, records = _run_turn(engine, wl)
    turn_ms = (time.perf_counter() - t0) * 1e3
    after = sum(r["after_first_ms"] for r in records)
    later_tokens = sum(max(r["output_tokens"] - 1, 0) for r in records)
    _fill(session, context)
    ttfts = [_warm_decision(session, wl).ttft_s * 1e3 for _ in range(repeats)]
    return {"calls": len(records), "valid_calls": sum(r["status"] == "ok" for r in records), "turn_ms": turn_ms,
            "pipeline": engine.pipeline, "drafted_ahead": sum(r["drafted_ahead"] for r in records),
            "ttft_p50_ms": statistics.median(r["ttft_ms"] for r in records),
            "itl_eff_ms": after / later_tokens if later_tokens else None,
            "warm_context_tokens": session.num_tokens, "warm_ttft_p50_ms": statistics.median(ttfts),
            "warm_ttfts_ms": ttfts, "turns": records}


def profile_decision(engine, wl, context: int) -> dict:
    """Gaps between the device kernels of the decode steps of one warm `decide()` (torch.profiler).

    The session is built as `agent_figures` builds its own (the AAL turn of `wl`, then sensor
    readings to `context` tokens); one warm decision on the first request runs unprofiled, then the
    same decision (rolled back in between) runs under `torch.profiler.profile` (CPU activity, and
    CUDA's on a CUDA device). The decode steps are the device activities that start after the
    decision's first token was chosen (the decide() range's start + its TTFT; the prefill of the
    trigger tokens ends before). The profiler's host-side recording slows the host, so the gaps
    are an upper bound: compare decide_ms with unprofiled_decide_ms.

    Returns:
        `kernel_gaps` of the decode steps (kernels 0 and "note" `NO_KERNELS` on a CPU), with
        ttft_ms, decide_ms (under the profiler), unprofiled_decide_ms, forwards, output_tokens.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    session, _ = _run_turn(engine, wl)
    _fill(session, context)
    plain = _warm_decision(session, wl)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        d = _warm_decision(session, wl)
    events = prof.events()
    # the host range (on CUDA the profile also holds a GPU range of that name, from its first kernel)
    decide = next(e for e in events if e.name == _DECIDE and e.device_type == DeviceType.CPU)
    first_token_us = decide.time_range.start + d.ttft_s * 1e6
    return {"ttft_ms": d.ttft_s * 1e3, "decide_ms": d.total_s * 1e3, "unprofiled_decide_ms": plain.total_s * 1e3,
            "forwards": d.forwards, "output_tokens": d.forced_tokens + d.generated_tokens,
            **kernel_gaps(k for k in device_kernels(events) if k.start_us >= first_token_us)}


# ---------------------------------------------------------------------------------- the run

class _Report:
    # Results dict written to out/gpu.json after every section; a section that raises is recorded.
    def __init__(self, out: Path | None, head: dict):
        self.data, self.path = {**head, "sections": {}, "failed": []}, (out / "gpu.json") if out else None
        if self.path:
            out.mkdir(parents=True, exist_ok=True)
        self.write()

    def section(self, name: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - one broken section must not cost the run's others
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=4)}
        entry = result if isinstance(result, dict) else {"rows": result}
        entry["section_s"] = time.perf_counter() - t0
        self.data["sections"][name] = entry
        if "error" in entry or entry.get("ok") is False:
            self.data["failed"].append(name)
        self.write()
        return result

    def write(self) -> None:
        if self.path:
            self.path.write_text(json.dumps(self.data, indent=1, default=str))


def run_gpu(device: str | None = None, quick: bool = False, out: Path | None = None, model: str | None = None,
            bfcl: str | None = None) -> dict:
    """Run the device check (see the module docstring), print its tables; returns the results.

    Args:
        device: "cuda", "cpu" or None (cuda when available).
        quick: tiny shapes, short contexts, few tokens and prompts (CPU tests).
        out: folder for gpu.json (written after each section), or None.
        model: the embedded model's stand-in: a .gguf file or safetensors folder (None: embedded;
            in quick mode "tiny-random").
        bfcl: BFCL folder (default `$TOKENSPEED_BFCL`, then the copy shipped with tokenspeed).
    Returns:
        {"device", "dtype", "torch", "triton", "threads", "bandwidth_gbs", "sections": {name: ...},
        "failed": [section names that raised or failed their check]}.
    Raises:
        ValueError: device "cuda" asked for but not available.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    from ..engine import Engine
    from .workload import build_workload

    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if cuda:
        big, contexts, steps, name, agent_ctx, n_prompts, n_new = LLAMA31_8B, (128, 4096), 64, "llama-3.1-8b-shape", 4096, PARITY_PROMPTS, 16
        pruned = KVConfig(budget=1024)
    elif quick:
        big, contexts, steps, name, agent_ctx, n_prompts, n_new = TINY, (16, 64), 4, "tiny-shape", 256, 2, 4
        pruned = KVConfig(budget=40, page=4, reserve=16, cold=64)
    else:
        big, contexts, steps, name, agent_ctx, n_prompts, n_new = SMALL, (128, 1024), 16, "small-shape", 2048, 4, 8
        pruned = KVConfig(budget=512)
    model = model if model is not None else ("tiny-random" if quick else None)
    rep = _Report(out, {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "dtype": str(dtype),
                        "torch": torch.__version__, "triton": triton_version, "threads": torch.get_num_threads(),
                        "brief": BRIEF, "goals": GOALS})
    bw = rep.section("bandwidth", lambda: {"gbs": device_bandwidth(dev, mib=2048 if cuda else (64 if quick else 256))})
    bw = bw.get("gbs") or float("nan")
    rep.data["bandwidth_gbs"] = bw
    rep.section("kernels", check_kernels, dev, quick)

    def raw_big():
        m = random_model(big, dev, dtype)
        try:
            return _raw_decode(f"{name} (random)", m, contexts, steps, dev, bw, pruned)
        finally:
            del m
            if cuda:
                torch.cuda.empty_cache()

    rep.section("decode_big", raw_big)
    loaded = {}

    def load():
        loaded["engine"] = e = Engine.load(model, device=str(dev), dtype=dtype, quantize=None)
        return {"source": e.source, "load_s": e.load_s}

    rep.section("load", load)
    engine = loaded.get("engine")
    if engine is None:
        _print(rep.data)
        return rep.data

    def parity():
        ref = Engine.load(model, device="cpu", dtype=torch.float32, quantize=None)
        ref.model.use_fused = False  # the plain torch path (same math): no C++ build on the device
        return check_parity(ref.model, engine.model, parity_prompts(engine.tokenizer, n_prompts, bfcl), n_new)

    rep.section("parity", parity)
    rep.section("decode_embedded", _raw_decode, f"{engine.source}", engine.model, contexts, steps, dev, bw, pruned)

    def workload():
        wl = build_workload(quick=quick, bfcl_dir=bfcl)
        # CPU tests run the code path, not figures: random weights decode to max_tokens
        return dataclasses.replace(wl, max_tokens=12) if quick else wl

    def agent(eng):
        return agent_figures(eng, workload(), agent_ctx, repeats=2 if quick else 5)

    def on_big_body(fn):
        # fn(engine) for the 8B-shaped body with the embedded model's vocabulary (random weights), then freed
        body = ModelArgs(**{**big.__dict__, "vocab_size": engine.args.vocab_size, "max_seq_len": 8192})
        big_engine = Engine(random_model(body, dev, dtype), engine.tokenizer, source=f"{name} body (random)")
        try:
            return fn(big_engine)
        finally:
            del big_engine
            if cuda:
                torch.cuda.empty_cache()

    def profile(eng):
        return {"model": eng.source, **profile_decision(eng, workload(), agent_ctx)}

    rep.section("agent_embedded", agent, engine)

    def serial(eng):  # the same figures without pipelined drafting (Engine.pipeline), for the A/B
        was, eng.pipeline = eng.pipeline, False
        try:
            return agent(eng)
        finally:
            eng.pipeline = was

    rep.section("agent_embedded_serial", serial, engine)
    rep.section("agent_big", on_big_body, agent)
    rep.section("profile", lambda: [profile(engine), on_big_body(profile)])
    if cuda:
        rep.data["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
        rep.write()
    _print(rep.data)
    return rep.data


def _fmt(v, digits: int = 2) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _print(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con, sec = Console(width=170), results["sections"]
    t = Table(title=f"raw decode vs floor on {results['device']} ({results['dtype']}), read bandwidth "
                    f"{_fmt(results.get('bandwidth_gbs'), 0)} GB/s; goal for the 8B shape: ITL <= "
                    f"{GOALS['decode_vs_floor']}x floor")
    for col in ("model", "weights", "step", "triton norm", "cache", "context", "attended", "TTFT ms", "ITL p50 ms", "ITL p90 ms", "floor+KV ms",
                "ITL / floor"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for key in ("decode_big", "decode_embedded"):
        for r in sec.get(key, {}).get("rows", []):
            t.add_row(r["model"], r["weights"], r["step"], "on" if r["triton_norm"] else "off", r["cache"], str(r["context"]),
                      str(r["attended"]), _fmt(r["ttft_ms"], 1),
                      _fmt(r["itl_p50_ms"]), _fmt(r["itl_p90_ms"]), _fmt(r["floor_ctx_ms"]), f"{r['itl_vs_floor']:.2f}x")
    con.print(t)
    a = Table(title="agent figures (warm sessions, jump-forward + speculation) vs the brief's column "
                    "(one H100, 7B; TokenSpeed as briefed / vLLM 0.6.0 / TensorRT-LLM 0.11)")
    for col in ("metric", "8B-shape body", "embedded", "brief TokenSpeed", "vLLM", "TensorRT-LLM", "goal"):
        a.add_column(col, justify="left" if col == "metric" else "right")
    big, emb = sec.get("agent_big", {}), sec.get("agent_embedded", {})
    for label, key, brief, goal in (("warm decide() TTFT, ~4K cached (ms)", "warm_ttft_p50_ms", "ttft_ms", "ttft_ms"),
                                    ("effective ITL on tool calls (ms)", "itl_eff_ms", "itl_ms", "itl_ms"),
                                    ("10-call AAL turn (ms)", "turn_ms", "turn_ms", None)):
        a.add_row(label, _fmt(big.get(key)), _fmt(emb.get(key)), *(f"{x:g}" for x in BRIEF[brief]),
                  f"<= {GOALS[goal]:g}" if goal else "-")
    con.print(a)
    ser = sec.get("agent_embedded_serial", {})
    if "itl_eff_ms" in ser and "itl_eff_ms" in emb:
        con.print(f"embedded, pipelined drafting {'on' if emb.get('pipeline') else 'off'} -> off: effective ITL "
                  f"{_fmt(emb['itl_eff_ms'])} -> {_fmt(ser['itl_eff_ms'])} ms, AAL turn {_fmt(emb['turn_ms'])} -> "
                  f"{_fmt(ser['turn_ms'])} ms (drafted ahead in {emb.get('drafted_ahead', 0)} steps)")
    par, ker = sec.get("parity", {}), sec.get("kernels", {})
    if "tokens" in par:
        con.print(f"parity vs CPU fp32: {par['identical_tokens']}/{par['tokens']} tokens identical over "
                  f"{par['prompts']} prompts, max relative logits error {par['max_rel_logit_err']:.2e} "
                  f"(tolerance {par['rtol']:g}): {'ok' if par['ok'] else 'FAILED'}")
    if "attention" in ker:
        con.print(f"Triton kernels vs torch: {'ok' if ker['ok'] else 'FAILED'} (attention worst out_rel "
                  f"{max(r['out_rel'] for r in ker['attention']):.1e}, norm worst "
                  f"{max(r['y_rel'] for r in ker['norm']):.1e})")
        if "triton_us" in ker["attention"][0]:
            k = Table(title="kernel times, CUDA-event medians (us)")
            for col in ("kernel", "shape", "Triton", "torch", "SDPA (no mass)"):
                k.add_column(col, justify="left" if col in ("kernel", "shape") else "right")
            for r in ker["attention"]:
                k.add_row("attention + slot mass", f"{r['layout']} {r['dtype']} S={r['slots']} T={r['rows']}",
                          _fmt(r["triton_us"], 1), _fmt(r["torch_mass_us"], 1), _fmt(r["sdpa_us"], 1))
            for r in ker["norm"]:
                k.add_row("rms norm" + (" + residual" if r["residual"] else ""), f"dim={r['dim']} rows={r['rows']}",
                          _fmt(r["fused_us"], 1), _fmt(r["torch_us"], 1), "-")
            con.print(k)
    prof = sec.get("profile", {}).get("rows", [])
    if prof:
        p = Table(title="device idle between the kernels of the decode steps of one warm decide() (torch.profiler; "
                        "its host-side recording makes the gaps an upper bound)")
        for col in ("model", "decide ms", "unprofiled ms", "kernels", "busy ms", "span ms", "idle", "gap p50 us",
                    "gap p90 us", "largest gap: before -> after"):
            p.add_column(col, justify="left" if col.startswith(("model", "largest")) else "right")
        for r in prof:
            top = r["largest"][0] if r["largest"] else None
            p.add_row(r["model"], _fmt(r["decide_ms"]), _fmt(r["unprofiled_decide_ms"]), str(r["kernels"]),
                      _fmt(r["busy_us"] and r["busy_us"] / 1e3), _fmt(r["span_us"] and r["span_us"] / 1e3),
                      "-" if r["idle_fraction"] is None else f"{100 * r['idle_fraction']:.0f}%",
                      _fmt(r["gap_p50_us"], 1), _fmt(r["gap_p90_us"], 1),
                      f"{top['gap_us']:.0f} us: {top['before'][:40]} -> {top['after'][:40]}" if top
                      else r.get("note", "-"))
        con.print(p)
    for name in results["failed"]:
        con.print(f"[bold red]section {name} failed[/]: {sec[name].get('error', 'check out of tolerance')}")
