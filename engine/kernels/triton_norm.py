"""Triton RMSNorm with the residual add fused in: one pass reads the residual stream and the
branch output, writes their sum and its normalised copy.

RMSNorm: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019). The numerics follow
`tokenspeed.kernels.norm.add_rms_norm` (Hugging Face LlamaRMSNorm): the sum is rounded to the
input dtype, normalised in fp32, rounded back, then scaled by the weight. Runs on CUDA, and on CPU
tensors under `TRITON_INTERPRET=1` (tests). Importing this module needs `triton`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["triton_add_rms_norm"]


@triton.jit
def _add_rms_norm(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, N, eps, sx, sr, sy, sh,
                  HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    x = tl.load(x_ptr + row * sx + cols, mask=cmask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * sr + cols, mask=cmask, other=0.0).to(tl.float32))
        x = x.to(h_ptr.dtype.element_ty)                   # the residual stream keeps its dtype
        tl.store(h_ptr + row * sh + cols, x, mask=cmask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * sy + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=cmask)


def triton_add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) * weight) in one kernel; delta None: (h, RMSNorm(h) * weight).

    Args:
        h, delta: [..., N] residual stream and branch output, same shape and dtype.
        weight: [N] norm weight. eps: added to the mean square.
    Returns:
        (sum [..., N] in h's dtype, normalised [..., N] in the promoted dtype of weight and h).
    Raises:
        ValueError: shapes disagree.
    """
    N = h.shape[-1]
    if weight.shape != (N,) or (delta is not None and delta.shape != h.shape):
        raise ValueError(f"rms norm shapes h {tuple(h.shape)} delta {None if delta is None else tuple(delta.shape)} "
                         f"weight {tuple(weight.shape)}")
    x = h.reshape(-1, N)
    if x.stride(-1) != 1:
        x = x.contiguous()
    r = delta.reshape(-1, N).contiguous() if delta is not None else x
    out_h = torch.empty_like(x) if delta is not None else x
    y = torch.empty(x.shape, dtype=torch.result_type(weight, h), device=h.device)
    _add_rms_norm[(x.shape[0],)](x, r, weight, y, out_h, N, eps, x.stride(0), r.stride(0), y.stride(0),
                                 out_h.stride(0), HAS_RES=delta is not None, BLOCK_N=triton.next_power_of_2(N))
    return out_h.view(h.shape), y.view(h.shape)
