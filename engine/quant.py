"""Weight-only quantized linears, swapped in for `nn.Linear` (gpt-fast style).

`quantize(model, "int4")` replaces every block projection with an `Int4Linear`: 4-bit codes in
groups of 32 input channels with a scale and a minimum per group - the layout of GGUF Q4_1, so a
model converted from a Q4_1 file gets its original codes back exactly (only the group scale and
minimum are rounded to bf16) - run by `torch._weight_int4pack_mm_for_cpu` (CPU only) for up to
`PACKED_ROWS_INT4` rows. Prefill-sized inputs use a dense bf16 copy of the same dequantized weight
instead: the avx512-bf16 GEMM runs ~2.4x faster than the packed kernel (or fp32) on prefill chunks
(measured, 1 thread), at 2 bytes per weight of memory. The lm_head becomes an `Int8Linear` (GGUF
files usually keep it at 8 bits).

`quantize(model, "int8")` replaces every projection of a `Transformer` (QKV, output, gate/up,
down and the lm_head) with an `Int8Linear`: int8 weights with one fp32 scale per output channel
(symmetric, scale = max|w_row| / 127). The embedding table stays in the model's dtype (a gather
reads one row per token); a tied lm_head gets its own int8 copy.

Decode-sized inputs (at most `PACKED_ROWS` rows) run `torch._weight_int8pack_mm`, which reads
the int8 weights directly (4x fewer bytes than fp32; activations are rounded to bf16 for it);
larger inputs (prefill) dequantize the weight once per call and use the dtype's GEMM, which is
faster for many rows. With the fused CPU decode extension built (`tokenspeed.kernels.cpu_decode`),
decode-sized inputs run its `int8_gemv` instead (fp32 activations, ~2x faster for the lm_head). `linear_rows` projects onto a subset of output rows (lm_head logits for
the few token ids a grammar allows) for both `nn.Linear` and `Int8Linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Int8Linear", "Int4Linear", "quantize", "linear_rows", "MODES", "PACKED_ROWS", "PACKED_ROWS_INT4"]

MODES = ("int8", "int4")
PACKED_ROWS = 32  # rows up to which the packed int8 kernel beats dequantize + GEMM (measured, 2-core CPU)
PACKED_ROWS_INT4 = 16  # rows up to which the packed int4 kernel beats the dense bf16 GEMM in a forward (weights
# streamed from memory, 1 thread: 11.5 vs 30.5 ms at 2 rows, 52 vs 54 ms at 14; a lone GEMM with its weight in
# cache favours bf16 from 6 rows)


def _has_int8pack(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """Weight-only int8 linear layer with per-output-channel scales.

    Buffers: qweight [out, in] int8, scales [out] fp32, scales_bf16 [out] bf16 (packed kernel),
    bias [out] or None (kept in the original dtype).

    forward(x [..., in]) -> [..., out] in x's dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scales)
        self.register_buffer("scales_bf16", scales.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """Quantize an `nn.Linear` (its weight is not modified)."""
        return cls(linear.weight, linear.bias)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as [out, in] of `dtype` (scales applied)."""
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        packed = x2.shape[0] <= PACKED_ROWS and _has_int8pack(x.device)
        if packed and (ext := _fused_ext()) is not None:
            y = ext.int8_gemv(x2.float(), self.qweight, self.scales).to(x.dtype)
        elif packed:
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self.qweight, self.scales_bf16).to(x.dtype)
        else:
            y = F.linear(x2, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int4Linear(nn.Module):
    """Weight-only 4-bit linear layer, asymmetric groups of `group_size` input channels (GGUF Q4_1 layout).

    w[n, k] = code[n, k] * scale[n, g] + min[n, g] with g = k // group_size, codes in 0..15.
    Buffers: packed (`torch._convert_weight_to_int4pack_for_cpu` layout), scale_zeros
    [in / group_size, out, 2] bf16 (the kernel's (code - 8) * scale + zero form), dense [out, in]
    bf16 (the same dequantized weight, for more than `PACKED_ROWS_INT4` rows), bias or None.

    forward(x [..., in]) -> [..., out] in x's dtype (activations rounded to bf16 for both kernels).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32):
        super().__init__()
        w = weight.detach().float()
        n, k = w.shape
        if not self.supports(w.shape, group_size):
            raise ValueError(f"Int4Linear needs in_features divisible by {group_size} and out_features by 8, got {n}x{k}")
        wg = w.reshape(n, k // group_size, group_size)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        codes = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).reshape(n, k)
        zero = lo + 8 * scale
        sz = torch.stack([scale, zero], -1).to(torch.bfloat16).float()  # what the packed kernel applies
        dense = ((codes - 8).reshape(n, k // group_size, group_size) * sz[..., :1] + sz[..., 1:]).reshape(n, k)
        self.in_features, self.out_features, self.group_size = k, n, group_size
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.register_buffer("scale_zeros", sz.transpose(0, 1).contiguous().to(torch.bfloat16))
        self.register_buffer("dense", dense.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @staticmethod
    def supports(shape: tuple[int, int], group_size: int = 32) -> bool:
        """Whether a weight of `shape` [out, in] fits the packed int4 kernel."""
        return shape[1] % group_size == 0 and shape[0] % 8 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if x2.shape[0] > PACKED_ROWS_INT4:
            y = F.linear(x2, self.dense).to(x.dtype)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scale_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group_size}"


def _fused_ext():
    from .kernels.cpu_decode import load

    return load()


def linear_rows(linear: nn.Module, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Project x [M, in] onto the output rows `rows` [K] int64 of an `nn.Linear` or `Int8Linear`.

    Returns [M, K] fp32. Reads K rows of the weight instead of all of them (lm_head logits for
    the token ids a grammar allows).

    Raises:
        TypeError: `linear` is neither an `nn.Linear` nor an `Int8Linear`.
    """
    if isinstance(linear, Int8Linear):
        y = F.linear(x.float(), linear.qweight.index_select(0, rows).float()) * linear.scales.index_select(0, rows)
    elif isinstance(linear, nn.Linear):
        y = F.linear(x, linear.weight.index_select(0, rows)).float()
    else:
        raise TypeError(f"linear_rows needs an nn.Linear or Int8Linear, got {type(linear).__name__}")
    if linear.bias is not None:
        y = y + linear.bias.index_select(0, rows).float()
    return y


def quantize(model: nn.Module, mode: str = "int8") -> nn.Module:
    """Replace every `nn.Linear` inside `model` (in place) with its quantized version.

    Call it after moving the model to its device and dtype (a later `.to()` would re-tie a tied
    lm_head to the float embedding).

    Args:
        model: a `tokenspeed.Transformer` (any module works).
        mode: "int8" (every linear `Int8Linear`) or "int4" (`Int4Linear` where the shape fits, the
            lm_head - a child named "output" - and any other linear `Int8Linear`).
    Returns:
        the same model.
    Raises:
        ValueError: unknown mode, or "int4" on a model that is not on the CPU.
    """
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {MODES}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if mode == "int4" and child.weight.device.type != "cpu":
                raise ValueError("int4 quantization runs on the CPU only; use int8 or the float model on this device")
            if mode == "int4" and name != "output" and Int4Linear.supports(child.weight.shape):
                setattr(parent, name, Int4Linear(child.weight, child.bias))
            else:
                setattr(parent, name, Int8Linear.from_linear(child))
    if hasattr(model, "invalidate_fused"):
        model.invalidate_fused()
    return model
