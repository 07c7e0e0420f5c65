"""Triton attention of a few query rows (decode, draft verification) over the hot KV slots,
returning per-slot attention mass.

Split-S ("flash-decoding") layout: kernel `_partial_attn` gives each (head, query row, split) an
online softmax over its share of the slots (Dao et al., FlashAttention; Flash-Decoding, 2023); the
splits are merged with their log-sum-exp; kernel `_slot_mass` then recomputes each slot's scores
for all heads and rows and sums exp(score - lse), so relevance scoring needs no [H, T, S] buffer.
Same contract as `tokenspeed.kernels.attention.attention_with_mass` (GQA, an optional [T, S] mask
such as verification's: cached slots visible, causal among the new rows). Runs on CUDA, and on CPU
tensors under `TRITON_INTERPRET=1` (tests). Importing this module needs `triton`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["decode_attention_with_mass"]


@triton.jit
def _partial_attn(q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, S, T, scale, slots_per_split,
                  sq_h, sq_t, sk_h, sk_s, sv_h, sv_s, sm_t,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_MASK: tl.constexpr):
    ht = tl.program_id(0)          # h * T + t
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    h = ht // T
    t = ht % T
    kvh = h // G
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + h * sq_h + t * sq_t + d, mask=dmask, other=0.0).to(tl.float32)
    lo = split * slots_per_split
    hi = tl.minimum(lo + slots_per_split, S)
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(lo, hi, BLOCK_S):
        s_idx = start + tl.arange(0, BLOCK_S)
        smask = s_idx < hi
        if HAS_MASK:
            smask = smask & (tl.load(mask_ptr + t * sm_t + s_idx, mask=smask, other=0) != 0)
        kt = tl.load(k_ptr + kvh * sk_h + s_idx[:, None] * sk_s + d[None, :],
                     mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        s = tl.sum(kt * q[None, :], axis=1) * scale
        s = tl.where(smask, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked tile so far: no NaN
        alpha = tl.exp(m - m_ref)
        p = tl.where(smask, tl.exp(s - m_ref), 0.0)
        vt = tl.load(v_ptr + kvh * sv_h + s_idx[:, None] * sv_s + d[None, :],
                     mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
    out = ht * n_splits + split
    tl.store(m_ptr + out, m)
    tl.store(l_ptr + out, l)
    tl.store(acc_ptr + out * D + d, acc, mask=dmask)


@triton.jit
def _slot_mass(q_ptr, k_ptr, mask_ptr, lse_ptr, mass_ptr, S, H, T, scale, sq_h, sq_t, sk_h, sk_s, sm_t,
               G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
               HAS_MASK: tl.constexpr):
    s_idx = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    smask = s_idx < S
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    total = tl.zeros((BLOCK_S,), tl.float32)
    for h in range(0, H):
        kvh = h // G
        kt = tl.load(k_ptr + kvh * sk_h + s_idx[:, None] * sk_s + d[None, :],
                     mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        for t in range(0, T):
            q = tl.load(q_ptr + h * sq_h + t * sq_t + d, mask=dmask, other=0.0).to(tl.float32)
            s = tl.sum(kt * q[None, :], axis=1) * scale
            p = tl.exp(s - tl.load(lse_ptr + h * T + t))
            if HAS_MASK:
                p = tl.where(tl.load(mask_ptr + t * sm_t + s_idx, mask=smask, other=0) != 0, p, 0.0)
            total += p
    tl.store(mass_ptr + s_idx, total, mask=smask)


def decode_attention_with_mass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                               block_s: int = 64, slots_per_split: int = 256):
    """Attention of T query rows (decode: 1; verification: a few) over S cached slots, with per-slot mass.

    Args:
        q: [1, H, T, D]; k, v: [1, Hkv, S, D] (H a multiple of Hkv; k/v may be slices of a larger
            cache: only the last dimension must be contiguous). Any float dtype; math in fp32.
        mask: [T, S] bool (True = attend) or None (every slot visible to every row). Each row must
            see at least one slot.
        block_s: slots per tile; slots_per_split: slots per (head, row, split) program.
    Returns:
        out [1, H, T, D] (q's dtype), mass [S] fp32 (sum over heads and rows of the softmax
        probability each slot received), lse [H, T] fp32 - as `attention_with_mass`.
    Raises:
        ValueError: H not a multiple of Hkv, shapes disagree, or a non-contiguous last dimension.
    """
    _, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if H % Hkv or k.shape != v.shape or k.shape[-1] != D or T < 1:
        raise ValueError(f"decode attention shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if mask is not None and tuple(mask.shape) != (T, S):
        raise ValueError(f"decode attention mask {tuple(mask.shape)}, expected {(T, S)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode attention needs a contiguous head dimension")
    n_splits = max(1, triton.cdiv(S, slots_per_split))
    scale = 1.0 / math.sqrt(D)
    dev = q.device
    m = torch.empty(H * T, n_splits, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    acc = torch.empty(H * T, n_splits, D, dtype=torch.float32, device=dev)
    block_d = triton.next_power_of_2(D)
    has_mask = mask is not None
    mk = mask.to(torch.int8).contiguous() if has_mask else m  # any pointer when there is no mask
    sm_t = mk.stride(0) if has_mask else 0
    _partial_attn[(H * T, n_splits)](q, k, v, mk, m, l, acc, S, T, scale, slots_per_split,
                                     q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
                                     sm_t, G=H // Hkv, D=D, BLOCK_S=block_s, BLOCK_D=block_d, HAS_MASK=has_mask)
    m_all = m.max(dim=1, keepdim=True).values                         # [H*T, 1]
    w = torch.exp(m - m_all) * (l > 0)                                # empty splits weigh 0
    denom = (w * l).sum(dim=1, keepdim=True)                          # [H*T, 1]
    out = ((w.unsqueeze(-1) * acc).sum(dim=1) / denom).view(1, H, T, D).to(q.dtype)
    lse = (m_all + torch.log(denom)).view(H, T).contiguous()          # [H, T]
    mass = torch.empty(S, dtype=torch.float32, device=dev)
    _slot_mass[(triton.cdiv(S, block_s),)](q, k, mk, lse, mass, S, H, T, scale, q.stride(1), q.stride(2),
                                           k.stride(1), k.stride(2), sm_t, G=H // Hkv, D=D, BLOCK_S=block_s,
                                           BLOCK_D=block_d, HAS_MASK=has_mask)
    return out, mass, lse
