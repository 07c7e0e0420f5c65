"""Triton decode attention (one query token) over the hot KV slots, returning slot mass.

Split-S ("flash-decoding") layout: kernel `_partial_attn` gives each (head, split) an online
softmax over its share of the slots (Dao et al., FlashAttention; Flash-Decoding, 2023); the
splits are merged with their log-sum-exp; kernel `_slot_mass` then recomputes each slot's
scores for all heads and sums exp(score - lse) so relevance scoring needs no [H, S] buffer.
Same contract as `tokenspeed.kernels.attention.attention_with_mass` for T == 1. Runs on CUDA,
and on CPU tensors under `TRITON_INTERPRET=1` (tests). Importing this module needs `triton`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _partial_attn(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr, S, scale, slots_per_split,
                  sq_h, sk_h, sk_s, sv_h, sv_s,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    kvh = h // G
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + h * sq_h + d, mask=dmask, other=0.0).to(tl.float32)
    lo = split * slots_per_split
    hi = tl.minimum(lo + slots_per_split, S)
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(lo, hi, BLOCK_S):
        s_idx = start + tl.arange(0, BLOCK_S)
        smask = s_idx < hi
        kt = tl.load(k_ptr + kvh * sk_h + s_idx[:, None] * sk_s + d[None, :],
                     mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        s = tl.sum(kt * q[None, :], axis=1) * scale
        s = tl.where(smask, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        p = tl.where(smask, p, 0.0)
        vt = tl.load(v_ptr + kvh * sv_h + s_idx[:, None] * sv_s + d[None, :],
                     mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
    out = h * n_splits + split
    tl.store(m_ptr + out, m)
    tl.store(l_ptr + out, l)
    tl.store(acc_ptr + out * D + d, acc, mask=dmask)


@triton.jit
def _slot_mass(q_ptr, k_ptr, lse_ptr, mass_ptr, S, H, scale, sq_h, sk_h, sk_s,
               G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    s_idx = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    smask = s_idx < S
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    total = tl.zeros((BLOCK_S,), tl.float32)
    for h in range(0, H):
        kvh = h // G
        q = tl.load(q_ptr + h * sq_h + d, mask=dmask, other=0.0).to(tl.float32)
        kt = tl.load(k_ptr + kvh * sk_h + s_idx[:, None] * sk_s + d[None, :],
                     mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        s = tl.sum(kt * q[None, :], axis=1) * scale
        total += tl.exp(s - tl.load(lse_ptr + h))
    tl.store(mass_ptr + s_idx, total, mask=smask)


def decode_attention_with_mass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               block_s: int = 64, slots_per_split: int = 256):
    """Attention of one query token over S cached slots, with per-slot mass.

    Args:
        q: [1, H, 1, D]; k, v: [1, Hkv, S, D] (may be slices of a larger cache: the last
            dimension must be contiguous). All slots are visible (decode has no mask).
        block_s: slots per tile; slots_per_split: slots per (head, split) program.
    Returns:
        out [1, H, 1, D] (q's dtype), mass [S] fp32, lse [H, 1] fp32 - as `attention_with_mass`.
    Raises:
        ValueError: T != 1, H not a multiple of Hkv, or a non-contiguous last dimension.
    """
    _, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if T != 1 or H % Hkv or k.shape != v.shape or k.shape[-1] != D:
        raise ValueError(f"decode attention shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode attention needs a contiguous head dimension")
    n_splits = max(1, triton.cdiv(S, slots_per_split))
    scale = 1.0 / math.sqrt(D)
    dev = q.device
    m = torch.empty(H, n_splits, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    acc = torch.empty(H, n_splits, D, dtype=torch.float32, device=dev)
    block_d = triton.next_power_of_2(D)
    _partial_attn[(H, n_splits)](q, k, v, m, l, acc, S, scale, slots_per_split,
                                 q.stride(1), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
                                 G=H // Hkv, D=D, BLOCK_S=block_s, BLOCK_D=block_d)
    m_all = m.max(dim=1, keepdim=True).values                         # [H, 1]
    w = torch.exp(m - m_all) * (l > 0)                                # empty splits weigh 0
    denom = (w * l).sum(dim=1, keepdim=True)                          # [H, 1]
    out = ((w.unsqueeze(-1) * acc).sum(dim=1) / denom).view(1, H, 1, D).to(q.dtype)
    lse = (m_all + torch.log(denom)).contiguous()                     # [H, 1]
    mass = torch.empty(S, dtype=torch.float32, device=dev)
    _slot_mass[(triton.cdiv(S, block_s),)](q, k, lse, mass, S, H, scale, q.stride(1), k.stride(1), k.stride(2),
                                           G=H // Hkv, D=D, BLOCK_S=block_s, BLOCK_D=block_d)
    return out, mass, lse
