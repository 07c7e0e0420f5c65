"""RMSNorm with an optional residual add: the torch reference (any device) and its dispatch to the
fused Triton kernel (`tokenspeed.kernels.triton_norm`) on CUDA when asked for."""
from __future__ import annotations

import functools

import torch

from . import attention

__all__ = ["rms_norm", "add_rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., N] scaled by weight [N]: computed in fp32 like Hugging Face LlamaRMSNorm,
    rounded to x's dtype before the weight multiplies it (Zhang & Sennrich, 2019)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (h + delta, rms_norm(h + delta)); delta None: (h, rms_norm(h)).

    Args:
        h, delta: [..., N] residual stream and branch output; weight [N]; eps as `rms_norm`.
        triton: use the fused Triton kernel when h is on CUDA (`attention.TRITON_DEVICES`) and Triton is installed (one pass
            instead of several; same numerics up to the order of the fp32 sum).
    Returns:
        (sum [..., N] in h's dtype, normalised [..., N]).
    """
    if triton and h.device.type in attention.TRITON_DEVICES and _triton_norm() is not None:
        return _triton_norm()(h, delta, weight, eps)
    if delta is not None:
        h = h + delta
    return h, rms_norm(h, weight, eps)


@functools.cache
def _triton_norm():
    try:
        from .triton_norm import triton_add_rms_norm
    except ImportError:
        return None
    return triton_add_rms_norm
