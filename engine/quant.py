"""Weight-only quantized linears, swapped in for `nn.Linear` (gpt-fast style).

`quantize(model, "int4")` replaces every block projection with an `Int4Linear`: 4-bit codes in
groups of 32 input channels with a scale and a minimum per group - the layout of GGUF Q4_1, so a
model converted from a Q4_1 file gets its original codes back exactly (only the group scale and
minimum are rounded to bf16) - multiplied with int8-quantized activations by the fused extension's
`int4_matmul` (the Q4_1 x Q8_1 scheme of llama.cpp; CPU only), for decode and prefill alike. The
lm_head becomes an `Int8Linear` (GGUF files usually keep it at 8 bits).

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

__all__ = ["Int8Linear", "Int4Linear", "quantize", "linear_rows", "MODES", "PACKED_ROWS"]

MODES = ("int8", "int4")
PACKED_ROWS = 32  # rows up to which the packed int8 kernel beats dequantize + GEMM (measured, 2-core CPU)


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
    """Weight-only 4-bit linear layer, asymmetric groups of 32 input channels (GGUF Q4_1 layout).

    w[n, k] = code[n, k] * scale[n, g] + min[n, g] with g = k // 32, codes in 0..15, scale and min
    rounded to bf16. Buffers: codes [out / 16, in / 8, 64] uint8 and scales [out / 16, in / 32, 2, 16]
    bf16 in the layout of the fused extension's `int4_matmul` (see `pack`), bias [out] or None.

    forward(x [..., in]) -> [..., out] in x's dtype. Each row's activations are quantized to int8
    per group of 32 (scale max|x| / 127) and multiplied with the codes in int32: the Q4_1 x Q8_1 scheme
    of GGML (llama.cpp), run by `int4_matmul` (AVX512-VNNI; 4.2 ms for all 120 block projections of
    SmolLM2-135M at 1 row, 5.4 ms at 4 rows, against 6.8 / 11.3 ms for torch's packed int4 kernel,
    1 thread). A row's result does not depend on the other rows in the call. Without the extension
    the same arithmetic runs in torch (`reference`; float rounding may differ slightly).

    Raises (constructor): ValueError if in_features is not a multiple of 32 or out_features of 16.
    """

    GROUP = 32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()
        n, k = w.shape
        if not self.supports(w.shape):
            raise ValueError(f"Int4Linear needs in_features divisible by {self.GROUP} and out_features by 16, got {n}x{k}")
        wg = w.reshape(n, k // self.GROUP, self.GROUP)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        codes = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).reshape(n, k)
        self.in_features, self.out_features = k, n
        packed_codes, scales = self.pack(codes, scale, lo)
        self.register_buffer("codes", packed_codes)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @staticmethod
    def supports(shape: tuple[int, int]) -> bool:
        """Whether a weight of `shape` [out, in] fits the int4 layout."""
        return shape[1] % Int4Linear.GROUP == 0 and shape[0] % 16 == 0

    @staticmethod
    def pack(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes [N, K] (0..15), scale and min [N, K / 32] -> (codes [N/16, K/8, 64] uint8, scales [N/16, K/32, 2, 16] bf16).

        Output block nb holds channels 16 nb .. 16 nb + 15, one per 32-bit lane; byte b (0..3) of
        lane j in input octet o has code k = 8o + b in its low nibble and k = 8o + 4 + b in its high one.
        """
        n, k = codes.shape
        nb, octets, groups = n // 16, k // 8, k // Int4Linear.GROUP
        c = codes.to(torch.uint8).reshape(nb, 16, octets, 2, 4)
        packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(nb, octets, 64).contiguous()
        per_block = [t.reshape(nb, 16, groups).permute(0, 2, 1) for t in (scale, minimum)]
        return packed, torch.stack(per_block, 2).to(torch.bfloat16).contiguous()

    def dequantized(self) -> torch.Tensor:
        """The weight as [out, in] fp32 (code * scale + min)."""
        nb, octets, _ = self.codes.shape
        c = self.codes.reshape(nb, octets, 16, 4).permute(0, 2, 1, 3)  # [nb, 16, octet, 4]
        codes = torch.stack([c & 15, c >> 4], 3).reshape(self.out_features, self.in_features).float()
        s, m = (self.scales[:, :, i].permute(0, 2, 1).reshape(self.out_features, -1).float() for i in (0, 1))
        g = self.GROUP
        return (codes.reshape(self.out_features, -1, g) * s[..., None] + m[..., None]).reshape(self.out_features, -1)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] fp32 -> [M, out] fp32: the W4A8 arithmetic of `int4_matmul` in torch (the fallback
        without the extension; it keeps the dequantized fp32 weight after the first call, 4 bytes per
        weight, and runs ~20x slower than the kernel: 86 vs 4.2 ms for SmolLM2-135M's projections
        at 1 row, 1 thread)."""
        xg = x.reshape(x.shape[0], -1, self.GROUP)
        amax = xg.abs().amax(-1, keepdim=True)
        q = torch.round(xg * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
        if getattr(self, "_weight", None) is None:
            self._weight = self.dequantized()
        return F.linear((q * (amax / 127)).reshape(x.shape), self._weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        ext = _fused_ext()
        y = ext.int4_matmul(x2, self.codes, self.scales) if ext is not None else self.reference(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.GROUP}, int8 activations"


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
