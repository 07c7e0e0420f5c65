"""Torch reference attention that also returns attention mass per KV slot and log-sum-exp.

SDPA does not expose the softmax probabilities, and relevance scoring (H2O-style heavy
hitters, Zhang et al. 2023) needs them: this path materialises the [H, T, S] scores once.
"""
from __future__ import annotations

import functools
import math

import torch

TRITON_ROWS = 16            # query rows up to which the Triton kernel runs (decode, verification); above, torch
TRITON_DEVICES = ("cuda",)  # device types whose tensors the Triton kernels take (tests add "cpu" under the interpreter)


def attention_with_mass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention with grouped-query heads, plus its probability mass.

    Args:
        q: [1, H, T, D] queries; k, v: [1, Hkv, S, D] keys/values (H a multiple of Hkv).
        mask: [T, S] bool (True = attend) or None (every slot visible to every query).
    Returns:
        out [1, H, T, D] (q's dtype); mass [S] fp32 = sum over heads and queries of the softmax
        probability each slot received; lse [H, T] fp32 = log-sum-exp of the scaled scores.
    Raises:
        ValueError: H is not a multiple of Hkv, or shapes disagree.
    """
    _, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if H % Hkv or k.shape != v.shape or k.shape[-1] != D:
        raise ValueError(f"attention shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    G = H // Hkv
    qg = q[0].reshape(Hkv, G * T, D).float()                               # [Hkv, G*T, D]
    s = torch.matmul(qg, k[0].float().transpose(-1, -2)) / math.sqrt(D)    # [Hkv, G*T, S]
    if mask is not None:
        s = s.view(Hkv, G, T, S).masked_fill(~mask, float("-inf")).view(Hkv, G * T, S)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)                         # [Hkv, G*T, 1]
    p = torch.exp(s - lse)
    out = torch.matmul(p, v[0].float()).view(1, H, T, D).to(q.dtype)
    return out, p.sum(dim=(0, 1)), lse.view(H, T)


def attention_mass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attention_with_mass`, dispatched: on CUDA with Triton installed, forwards of at most
    `TRITON_ROWS` query rows (decode, draft verification with its [T, S] mask) run the Triton
    kernel (`tokenspeed.kernels.triton_decode`); the torch reference otherwise (CPU, prefill).
    Same arguments and results."""
    if q.device.type in TRITON_DEVICES and q.shape[2] <= TRITON_ROWS and _triton_decode() is not None:
        return _triton_decode()(q, k, v, mask)
    return attention_with_mass(q, k, v, mask)


@functools.cache
def _triton_decode():
    try:
        from .triton_decode import decode_attention_with_mass
    except ImportError:
        return None
    return decode_attention_with_mass
