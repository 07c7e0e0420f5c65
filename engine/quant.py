"""Weight-only quantized linears, swapped in for `nn.Linear` (gpt-fast style) by `quantize`.

- "int4": block projections get 4-bit codes in groups of 32 input channels with a scale and a
  minimum per group (the GGUF Q4_1 layout: a model converted from a Q4_1 file gets its codes back).
  On the CPU `Int4Linear` multiplies them with int8-quantized activations in the fused extension
  (llama.cpp's Q4_1 x Q8_1 scheme); on CUDA `Int4TinygemmLinear` runs torch's int4 kernel.
  The lm_head becomes an `Int8Linear` (GGUF files usually keep it at 8 bits).
- "int8": every projection, the lm_head included, gets int8 weights with one fp32 scale per output
  channel (`Int8Linear`); on the CPU the fused extension's `int8_gemv` multiplies them with
  int8-quantized activations (llama.cpp's Q8_0 x Q8_0 scheme); elsewhere decode-sized inputs run
  torch's `_weight_int8pack_mm`, larger ones dequantize once per call.
On the CPU the token embedding table becomes an `Int8Embedding` in both modes (int8 in groups of 32,
the GGUF Q8_0 layout: exact for a Q8_0 table, a quarter of fp32's memory).
A GGUF file's Q4_K, Q5_K, Q6_K and Q5_0 tensors (`tokenspeed.weights.load_gguf`) run in their own format:
`BlockLinear`, one class per `BlockFormat` (`Q4KLinear`, `Q5KLinear`, `Q6KLinear`: the fused extension's
`block_gemv` on the blocks as stored; `Q5_0Linear`: `q5_0_gemv` on the blocks interleaved by 16 rows,
`pack_q5_0`; all with int8 activations), and `BlockEmbedding` (one per format), whose blocks a tied head
shares.
`linear_rows` projects onto a subset of output rows (the lm_head logits of the ids a grammar allows).
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Int8Linear", "Int4Linear", "Q4KInt4Linear", "StackedLinear", "Int8Embedding", "Int4TinygemmLinear", "BlockFormat", "BlockLinear",
           "BlockEmbedding", "Q4KLinear", "Q4KEmbedding", "Q5KLinear", "Q5KEmbedding", "Q6KLinear", "Q6KEmbedding",
           "Q5_0Linear", "Q5_0Embedding", "BLOCK_LINEARS", "BLOCK_EMBEDDINGS", "Q4_K", "Q5_K", "Q6_K", "Q5_0",
           "qk_dequantize", "q6k_dequantize", "q5_0_dequantize", "pack_q5_0", "unpack_q5_0", "QUANTIZED", "q4_1_groups", "gguf_int4_groups", "int8_groups",
           "pack_int8", "unpack_int8",
           "GGUF_INT4_TYPES", "linear_bytes", "quantize", "linear_rows", "fused_ext", "choose_format", "cached_format",
           "FormatChoice", "MODES", "FORMATS", "PACKED_ROWS"]

MODES = ("int8", "int4")
FORMATS = ("fp32",) + MODES  # what `choose_format` times: fp32 (no quantization) and each mode
log = logging.getLogger(__name__)
PACKED_ROWS = 32  # rows up to which the packed int8 kernel beats dequantize + GEMM (measured, 2-core CPU)


@functools.cache
def _has_int8pack(device_type: str) -> bool:
    # torch's weight-only int8 kernel is registered for this device type (CPU; CUDA in CUDA builds)
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", key)


def q4_1_groups(weight: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of `group` input channels (the GGUF Q4_1 scheme): weight [N, K] float ->
    (codes [N, K] uint8 in 0..15, scale [N, K / group] fp32, minimum [N, K / group] fp32) with
    weight ~ code * scale + minimum, computed on the weight's device.

    Raises:
        ValueError: K is not a multiple of `group`.
    """
    w = weight.detach().float()
    n, k = w.shape
    if k % group:
        raise ValueError(f"4-bit groups of {group} need in_features divisible by {group}, got {n}x{k}")
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    codes = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return codes, scale, lo


# GGUF block types whose values are exactly 4-bit codes in groups of 32 with a scale and a minimum
# (w = code * scale + min): bytes per block and values per block (ggml's block_q4_0, block_q4_1).
# Their blocks repack into `Int4Linear` without re-quantization (Q4_K's: `Q4KInt4Linear`).
GGUF_INT4_TYPES = {"Q4_0": (18, 32), "Q4_1": (20, 32)}


def gguf_int4_groups(blocks: np.ndarray, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 4-bit codes, scales and minimums of a GGUF tensor in one of `GGUF_INT4_TYPES`, read from its
    blocks as stored (no dequantization, no re-quantization): weight = code * scale + min per group of 32.

    - Q4_0 (fp16 d, 16 bytes of codes q): w = (q - 8) d, so scale = d and min = -8 d.
    - Q4_1 (fp16 d, fp16 m, 16 bytes of codes): w = q d + m.
    Byte j of a 32-value run holds value j in its low nibble and value j + 16 in its high one.

    Args:
        blocks: [N, K / values_per_block * bytes_per_block] uint8, one row per output channel (a
            `gguf.GGUFReader` tensor's `data`; may be a read-only memory map).
        qtype: "Q4_0" or "Q4_1".
    Returns:
        codes [N, K] uint8 (0..15), scale [N, K / 32] fp32, minimum [N, K / 32] fp32 (`Int4Linear.pack` input).
    Raises:
        ValueError: an unknown qtype, or a row length that is not a whole number of blocks.
    """
    if qtype not in GGUF_INT4_TYPES:
        raise ValueError(f"{qtype} blocks are not 4-bit groups of 32; choose one of {tuple(GGUF_INT4_TYPES)}")
    size, per_block = GGUF_INT4_TYPES[qtype]
    n, row_bytes = blocks.shape
    if row_bytes % size:
        raise ValueError(f"{qtype} rows of {row_bytes} bytes are not whole blocks of {size}")
    b = np.asarray(blocks).reshape(n, row_bytes // size, size)

    def half(at: int) -> np.ndarray:  # [N, blocks] fp16 field at byte offset `at` -> fp32
        return np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)

    at = 2 if qtype == "Q4_0" else 4
    qs = b[..., at:]
    codes = np.concatenate([qs & 15, qs >> 4], -1)  # [N, blocks, 32]
    scale = half(0)
    minimum = -8 * scale if qtype == "Q4_0" else half(2)
    return (torch.from_numpy(codes.reshape(n, -1)), torch.from_numpy(scale.reshape(n, -1)),
            torch.from_numpy(np.ascontiguousarray(minimum.reshape(n, -1))))


def _bare(cls) -> nn.Module:
    """A `cls` module without its constructor's work (no buffers yet): for `cls._store` to fill."""
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    return layer


def _uninitialised(cls, linear: nn.Linear, *weights: torch.Tensor, **store) -> nn.Module:
    """A `cls` layer holding the uninitialised `weights` (and a bias buffer when `linear` has one),
    for `load_state_dict` to fill; `cls._store` names the buffers (`store`: its other arguments)."""
    layer = _bare(cls)
    bias = linear.bias
    layer._store(*weights, None if bias is None else torch.empty(bias.shape[0], dtype=bias.dtype), **store)
    return layer


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 codes [N, K] and fp32 scales [N] (one per row) or [N, G] (per group) -> the CPU kernel's layout
    (`int8_gemv`, cpu_kernels.h `ts_int8_rows`), interleaved by 16 output rows: (codes [ceil(N / 16), Kp / 4, 64]
    int8, scales [ceil(N / 16), G, 16] fp32; G = 1 for per-row scales), Kp = K rounded up to a multiple of 32.

    Block b holds rows 16 b .. 16 b + 15, one per 32-bit lane: byte 4 j + i of its chunk c is code[16 b + j,
    4 c + i], and scales[b, g, j] is row 16 b + j's; codes and scales past row N and channel K are zero.
    """
    n, k = codes.shape
    s = scales.reshape(n, -1)
    nb, kp = -(-n // 16), -(-k // 32) * 32
    c = F.pad(codes, (0, kp - k, 0, nb * 16 - n))
    packed = c.reshape(nb, 16, kp // 4, 4).transpose(1, 2).reshape(nb, kp // 4, 64).contiguous()
    return packed, F.pad(s, (0, 0, 0, nb * 16 - n)).reshape(nb, 16, -1).transpose(1, 2).contiguous()


def unpack_int8(codes: torch.Tensor, scales: torch.Tensor, n: int, k: int,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_int8`'s inverse for a weight of `n` rows and `k` input channels: (codes [R, k] int8, scales [R, G]
    fp32) of the rows `rows` ([R] int64; None: all n, as views where the layout allows)."""
    nb, chunks, _ = codes.shape
    c = codes.view(nb, chunks, 16, 4)
    if rows is None:
        return (c.transpose(1, 2).reshape(nb * 16, chunks * 4)[:n, :k],
                scales.transpose(1, 2).reshape(nb * 16, -1)[:n])
    return c[rows // 16, :, rows % 16].reshape(-1, chunks * 4)[:, :k], scales[rows // 16, :, rows % 16]


def int8_groups(n: int, k: int, rows: Callable[[int, int], torch.Tensor], group: int, device=None,
                chunk_values: int = 1 << 21, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of a float [n, k] weight given by row blocks (`rows(a, b)` -> [b - a, k]), one
    fp32 scale per `group` consecutive values of a row: scale = max |w| / 127 of the group, code =
    round(w / scale) (GGML's Q8_0 rule; an all-zero group has scale 0 and codes 0). Values that came
    from a Q8_0 block (code * fp16 scale, its largest code +-127) come back exactly.

    Returns:
        (codes [n, k] int8, scales [n, k / group] fp32), or with `packed` the CPU kernel's layout of them
        (`pack_int8`), made in blocks of about `chunk_values` values (whole rows, 16 at least; 2M: 8 MiB of
        fp32 rows and their temporaries, never the whole weight's).
    Raises:
        ValueError: k is not a multiple of `group`.
    """
    if k % group:
        raise ValueError(f"int8 groups of {group} need a width divisible by {group}, got {k}")
    if packed:
        q = torch.empty(-(-n // 16), -(-k // 32) * 8, 64, dtype=torch.int8, device=device)
        scales = torch.empty(q.shape[0], k // group, 16, device=device)
    else:
        q = torch.empty(n, k, dtype=torch.int8, device=device)
        scales = torch.empty(n, k // group, device=device)
    chunk = max(16, chunk_values // k // 16 * 16)
    for r in range(0, n, chunk):
        w = rows(r, min(r + chunk, n)).detach().float().unflatten(-1, (-1, group))
        s = w.abs().amax(-1, keepdim=True) / 127.0
        codes = torch.round(w / torch.where(s > 0, s, 1.0)).clamp_(-127, 127).flatten(-2).to(torch.int8)
        if packed:
            codes, s = pack_int8(codes, s[..., 0])
            q[r // 16:r // 16 + codes.shape[0]], scales[r // 16:r // 16 + codes.shape[0]] = codes, s
        else:
            q[r:r + chunk], scales[r:r + chunk] = codes, s[..., 0]
    return q, scales


class Int8Linear(nn.Module):
    """Weight-only int8 linear layer: one scale per output channel (`group` None, what `quantize`
    makes), or one per `group` input channels of a row (`load_gguf`: group 32 keeps a GGUF file's Q8_0
    blocks exactly, and re-quantizes Q5/Q6 values with 8-bit codes per 32 instead of per row; `tied`:
    a tied lm_head on an `Int8Embedding`'s groups).
    Codes and scales follow `int8_groups`.

    Buffers: the layout is the device's own, made where the layer is built (a layer moved to another
    device type after it is built no longer fits its kernel). On the CPU the fused extension's
    (`pack_int8`: interleaved by 16 output rows): qweight [ceil(out / 16), in' / 4, 64] int8 (in' = in
    rounded up to a multiple of 32; rows and channels past the weight's are zero), scales [ceil(out / 16),
    1 or in / group, 16] fp32. Elsewhere torch's (`_weight_int8pack_mm`): qweight [out, in] int8, scales
    [out] or [out, in / group] fp32. `rows_of` gives the codes and scales row-major from either. bias
    [out] or None (kept in the original dtype).

    forward(x [..., in]) -> [..., out] in x's dtype. On the CPU it runs the fused extension's
    `int8_gemv`: each row's activations quantized to int8 per group of 32 and multiplied with the codes
    in int32 (llama.cpp's Q8_0 x Q8_0 scheme, `reference` in torch); a row's result does not depend on
    the other rows in the call, as in the fused decode step. Without the extension the CPU layer
    dequantizes once per call. Elsewhere (CUDA) decode-sized inputs (<= `PACKED_ROWS` rows) run torch's
    `_weight_int8pack_mm`, larger ones dequantize once per call.

    Raises (constructors): ValueError if `group` does not divide in_features.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int | None = None):
        super().__init__()
        self._store(*self._quantized(*weight.shape, lambda a, b: weight[a:b], weight.device, group),
                    None if bias is None else bias.detach().clone(), shape=weight.shape, group=group)

    @classmethod
    def from_rows(cls, out_features: int, in_features: int, rows: Callable[[int, int], torch.Tensor],
                  bias: torch.Tensor | None = None, device=None, group: int | None = None) -> "Int8Linear":
        """A layer of a weight given by row blocks: `rows(a, b)` -> float [b - a, in_features] (output rows
        a..b-1, e.g. dequantized from a file), so no float copy of the whole weight is needed."""
        layer = _bare(cls)
        layer._store(*cls._quantized(out_features, in_features, rows, device, group), bias,
                     shape=(out_features, in_features), group=group)
        return layer

    @staticmethod
    def _quantized(n: int, k: int, rows: Callable[[int, int], torch.Tensor], device, group: int | None) -> tuple:
        packed = device is None or torch.device(device).type == "cpu"
        q, scales = int8_groups(n, k, rows, group or k, device, packed=packed)
        return q, scales if group or packed else scales[:, 0]

    def _store(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
               shape: tuple[int, int], group: int | None) -> None:
        self.out_features, self.in_features = shape
        self.group = group
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def tied(cls, embedding: "Int8Embedding") -> "Int8Linear":
        """The lm_head of a model that ties it to its `Int8Embedding`: the table's own int8 codes and
        group scales (the same tensors, no copy), so the head runs exactly the table a GGUF file's Q8_0
        blocks or `int8_groups` made, and the model holds the tied weight once (SmolLM2-135M: 27 MB less).

        Returns:
            an `Int8Linear` [embedding_dim -> num_embeddings] with `group` = `Int8Embedding.GROUP`, no bias.
        """
        layer = _bare(cls)
        layer._store(embedding.qweight, embedding.scales, None, shape=(embedding.num_embeddings, embedding.embedding_dim),
                     group=embedding.GROUP)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """Quantize an `nn.Linear` (its weight is not modified)."""
        return cls(linear.weight, linear.bias)

    @classmethod
    def empty(cls, linear: nn.Linear, group: int | None = None) -> "Int8Linear":
        """An uninitialised CPU layer of `linear`'s shape (`linear` may be on the meta device) and `group`,
        for `load_state_dict` to fill (the quantized weights cache, `tokenspeed.weights`)."""
        n, k = linear.weight.shape
        blocks = -(-n // 16)
        return _uninitialised(cls, linear, torch.empty(blocks, -(-k // 32) * 8, 64, dtype=torch.int8),
                              torch.empty(blocks, k // group if group else 1, 16), shape=(n, k), group=group)

    def rows_of(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [R, in] int8, scales [R] (per channel) or [R, in / group] fp32) of the output rows `rows`
        ([R] int64; None: all), row-major whatever the layout."""
        if self.qweight.dim() == 3:
            q, s = unpack_int8(self.qweight, self.scales, self.out_features, self.in_features, rows)
            return q, s if self.group else s[:, 0]
        return (self.qweight, self.scales) if rows is None else (self.qweight[rows], self.scales[rows])

    def dequantized(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight as [out, in] of `dtype` (scales applied); with `rows` ([R] int64), only those
        output rows, [R, in]."""
        q, s = self.rows_of(rows)
        if self.group is None:
            return q.to(dtype) * s.to(dtype)[:, None]
        return (q.to(dtype).unflatten(-1, (-1, self.group)) * s.to(dtype)[..., None]).flatten(-2)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] fp32 -> [M, out] fp32 (bias not added): the W8A8 arithmetic of `int8_gemv` in torch.
        Each row of x is quantized per group of 32 channels (the last one shorter when in_features is
        not a multiple of 32) to q = round(x * 127 / max|x|) with scale max|x| / 127, as the kernel
        does in fp32; the products with the codes are summed exactly per group, then scaled (float64)."""
        m, k = x.shape
        pad = -k % 32
        xg = F.pad(x.float(), (0, pad)).reshape(m, -1, 32)
        amax = xg.abs().amax(-1, keepdim=True)
        q = torch.round(xg * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
        codes, scales = self.rows_of()
        w = F.pad(codes.double(), (0, pad)).reshape(self.out_features, -1, 32)
        sums = torch.einsum("mgk,ngk->mng", q.double(), w)  # exact: |sum| < 2^53
        ws = scales.double().reshape(self.out_features, -1)  # [out, 1] or [out, groups]
        return (sums * ws * (amax / 127)[..., 0].double()[:, None, :]).sum(-1).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        cpu_layout = self.qweight.dim() == 3
        ext = fused_ext() if cpu_layout and x.device.type == "cpu" else None
        if ext is not None:  # W8A8 for any number of rows: a row's result never depends on the others
            y = ext.int8_gemv(x2.float(), self.qweight, self.scales)[:, :self.out_features].to(x.dtype)
        elif cpu_layout or self.group is not None:
            y = F.linear(x2, self.dequantized(x.dtype))
        elif x.device.type == "cuda" and x2.shape[0] <= PACKED_ROWS and _has_int8pack("cuda"):  # fp32 accumulation
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            y = F.linear(x2, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = "per-channel" if self.group is None else f"groups of {self.group}"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 {kind}"


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
        self._require(weight.shape)
        self._store(*self.pack(*q4_1_groups(weight, self.GROUP)), None if bias is None else bias.detach().clone())

    @classmethod
    def from_groups(cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    bias: torch.Tensor | None = None) -> "Int4Linear":
        """A layer of given groups (codes [N, K] 0..15, scale and min [N, K / 32]; `q4_1_groups` or
        `gguf_int4_groups`), packed as they are: a GGUF file's own 4-bit codes, no re-quantization
        (scale and min are rounded to bf16 as in every `Int4Linear`).

        Raises:
            ValueError: the shape does not fit the layout (`supports`).
        """
        cls._require(codes.shape)
        layer = _bare(cls)
        layer._store(*cls.pack(codes, scale, minimum), bias)
        return layer

    def _store(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = codes.shape[0] * 16, codes.shape[1] * 8
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def empty(cls, linear: nn.Linear) -> "Int4Linear":
        """An uninitialised CPU layer of `linear`'s shape (`linear` may be on the meta device), for
        `load_state_dict` to fill (the quantized weights cache, `tokenspeed.weights`)."""
        n, k = linear.weight.shape
        return _uninitialised(cls, linear, torch.empty(n // 16, k // 8, 64, dtype=torch.uint8),
                              torch.empty(n // 16, k // cls.GROUP, 2, 16, dtype=torch.bfloat16))

    @staticmethod
    def supports(shape: tuple[int, int]) -> bool:
        """Whether a weight of `shape` [out, in] fits the int4 layout."""
        return shape[1] % Int4Linear.GROUP == 0 and shape[0] % 16 == 0

    @staticmethod
    def _require(shape: tuple[int, int]) -> None:
        if not Int4Linear.supports(shape):
            raise ValueError(f"Int4Linear needs in_features divisible by {Int4Linear.GROUP} and out_features by 16, "
                             f"got {shape[0]}x{shape[1]}")

    @staticmethod
    def pack(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes [N, K] (0..15), scale and min [N, K / 32] -> (codes [N/16, K/8, 64] uint8, scales [N/16, K/32, 2, 16] bf16).

        Output block nb holds channels 16 nb .. 16 nb + 15, one per 32-bit lane; byte b (0..3) of
        lane j in input octet o has code k = 8o + b in its low nibble and k = 8o + 4 + b in its high one.
        """
        n, k = codes.shape
        nb, groups = n // 16, k // Int4Linear.GROUP
        per_block = [t.reshape(nb, 16, groups).permute(0, 2, 1) for t in (scale, minimum)]
        return Int4Linear.pack_codes(codes), torch.stack(per_block, 2).to(torch.bfloat16).contiguous()

    @staticmethod
    def pack_codes(codes: torch.Tensor) -> torch.Tensor:
        """Codes [N, K] (0..15) -> [N/16, K/8, 64] uint8, the layout `pack` describes."""
        n, k = codes.shape
        nb, octets = n // 16, k // 8
        c = codes.to(torch.uint8).reshape(nb, 16, octets, 2, 4)
        return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(nb, octets, 64).contiguous()

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, min), each [out, in / 32] fp32 (the bf16 values widened)."""
        return tuple(self.scales[:, :, i].permute(0, 2, 1).reshape(self.out_features, -1).float() for i in (0, 1))

    def dequantized(self) -> torch.Tensor:
        """The weight as [out, in] fp32 (code * scale + min)."""
        nb, octets, _ = self.codes.shape
        c = self.codes.reshape(nb, octets, 16, 4).permute(0, 2, 1, 3)  # [nb, 16, octet, 4]
        codes = torch.stack([c & 15, c >> 4], 3).reshape(self.out_features, self.in_features).float()
        s, m = self.group_scales()
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
        ext = fused_ext()
        y = ext.int4_matmul(x2, self.codes, self.scales) if ext is not None else self.reference(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.GROUP}, int8 activations"


class Q4KInt4Linear(Int4Linear):
    """A GGUF file's Q4_K projection run by the W4A8 kernel of `Int4Linear`, its weights exactly the file's.

    The same 4-bit codes and arithmetic as `Int4Linear`, but the scales stay Q4_K's two-level ones instead
    of bf16 per group: per super-block of 256 input channels fp16 d and dmin, per group of 32 a 6-bit sc and
    m, w = code * (d sc) - dmin m. The kernel forms d sc and dmin m in fp32, exactly (11 x 6 significant
    bits), so the layer multiplies by the file's values, not bf16 roundings of them, and reads 9.25 bytes per
    16 weights where `Int4Linear` reads 10 (the file's Q4_K: 9).

    Buffers: codes [out / 16, in / 8, 64] uint8 (`Int4Linear.pack`) and scales [out / 16, in / 256, 320] uint8
    (`pack_super`), bias [out] or None. forward as `Int4Linear`'s.

    Raises (constructors): ValueError if in_features is not a multiple of 256 or out_features of 16.
    """

    SUPER = 256  # input channels per Q4_K super-block
    SCALE_BYTES = 320  # per output block of 16 rows and super-block: d, -dmin [16] fp16, then 8 x (sc, m) [16] int8

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        raise TypeError("Q4KInt4Linear holds a GGUF file's Q4_K blocks: use Q4KInt4Linear.from_blocks")

    @classmethod
    def from_groups(cls, *args, **kwargs):
        raise TypeError("Q4KInt4Linear holds a GGUF file's Q4_K blocks: use Q4KInt4Linear.from_blocks")

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> "Q4KInt4Linear":
        """A layer of a GGUF file's Q4_K blocks [N, K / 256 * 144] uint8 (one row per output channel), exactly.

        Raises:
            ValueError: not uint8 [N, whole blocks], the shape does not fit the layout (`supports`), or a
                block's d or dmin is not finite (a corrupt file).
        """
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[0] == 0:
            raise ValueError(f"Q4_K blocks must be uint8 [N, K / 256 * 144], got {blocks.dtype} {tuple(blocks.shape)}")
        lead, b = _whole_blocks(blocks, Q4_K)
        n, k = lead[0], b.shape[0] // lead[0] * cls.SUPER
        cls._require((n, k))
        d, dmin, sc, m = _k_scale_parts(b)
        if not (torch.isfinite(d).all() and torch.isfinite(dmin).all()):
            raise ValueError("Q4_K blocks with a non-finite d or dmin")
        qs = b[:, 16:].reshape(n, -1, 4, 1, 32)
        codes = torch.cat([qs & 15, qs >> 4], 3).reshape(n, k)  # each run of 32 bytes: two sub-blocks
        layer = _bare(cls)
        scales = cls.pack_super(d.reshape(n, -1), dmin.reshape(n, -1), sc.reshape(n, -1, 8), m.reshape(n, -1, 8))
        layer._store(cls.pack_codes(codes), scales, bias)
        return layer

    @classmethod
    def pack_super(cls, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """d and dmin [N, S] fp16, sc and m [N, S, 8] uint8 (6-bit) of S super-blocks per row -> scales
        [N / 16, S, 320] uint8: per output block and super-block, d [16] and -dmin [16] fp16 (lane j: row 16 nb + j),
        then per group g its sc [16] and m [16] (int8 0..63)."""
        n, S = d.shape
        nb = n // 16

        def lanes(t: torch.Tensor) -> torch.Tensor:  # [N, S, ...] -> [nb, S, ..., 16]
            t = t.reshape(nb, 16, *t.shape[1:])
            return t.permute(0, *range(2, t.dim()), 1)

        halves = torch.stack([lanes(d), lanes(-dmin)], 2).contiguous().view(torch.uint8).reshape(nb, S, 64)
        small = torch.stack([lanes(sc), lanes(m)], 3).reshape(nb, S, 256)
        return torch.cat([halves, small.to(torch.uint8)], 2).contiguous()

    @classmethod
    def empty(cls, linear: nn.Linear) -> "Q4KInt4Linear":
        """An uninitialised CPU layer of `linear`'s shape (`linear` may be on the meta device), for
        `load_state_dict` to fill (the quantized weights cache, `tokenspeed.weights`)."""
        n, k = linear.weight.shape
        return _uninitialised(cls, linear, torch.empty(n // 16, k // 8, 64, dtype=torch.uint8),
                              torch.empty(n // 16, k // cls.SUPER, cls.SCALE_BYTES, dtype=torch.uint8))

    @staticmethod
    def supports(shape: tuple[int, int]) -> bool:
        """Whether a weight of `shape` [out, in] fits the layout (whole super-blocks, blocks of 16 rows)."""
        return shape[1] % Q4KInt4Linear.SUPER == 0 and shape[0] % 16 == 0

    @staticmethod
    def _require(shape: tuple[int, int]) -> None:
        if not Q4KInt4Linear.supports(shape):
            raise ValueError(f"Q4KInt4Linear needs in_features divisible by {Q4KInt4Linear.SUPER} and out_features "
                             f"by 16, got {shape[0]}x{shape[1]}")

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d sc, -dmin m), each [out, in / 32] fp32: the exact per-group scale and minimum."""
        nb, S, _ = self.scales.shape
        halves = self.scales[..., :64].contiguous().view(torch.float16).reshape(nb, S, 1, 2, 16).float()
        small = self.scales[..., 64:].view(torch.int8).reshape(nb, S, 8, 2, 16).float()
        both = (halves * small).permute(3, 0, 4, 1, 2).reshape(2, self.out_features, S * 8)  # [2, N, G]
        return both[0], both[1]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.GROUP}, "
                f"Q4_K scales, int8 activations")


class Int4TinygemmLinear(nn.Module):
    """Weight-only 4-bit linear layer for torch's int4 kernel (`torch._weight_int4pack_mm`,
    "tinygemm": the kernel of gpt-fast and torchao's int4 weight-only layers), bf16 activations. The
    weights' groups are those of `Int4Linear` (`q4_1_groups`: 32 input channels, w = code * scale + min);
    the kernel computes (code - 8) * scale + zero with zero = min + 8 * scale.

    The packed layout is the device's own, made where the layer is built: on CUDA (sm80+)
    `_convert_weight_to_int4pack` [N / 8, K / (16 tiles), 32, tiles / 2] int32; on the CPU the CPU
    kernel's (`_for_cpu` ops, [N, K / 2] uint8), where the tests check the conversion. A layer moved to
    another device type after it is built no longer fits its kernel (torch raises).

    Buffers: packed (see above), scales_and_zeros [K / 32, N, 2] bf16, bias [N] or None.
    forward(x [..., in]) -> [..., out] in x's dtype (computed in bf16).

    Raises (constructor): ValueError if in_features is not a multiple of 32 or out_features of 8.
    """

    GROUP = 32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        n, k = weight.shape
        if not self.supports(weight.shape):
            raise ValueError(f"Int4TinygemmLinear needs in_features divisible by {self.GROUP} and out_features by 8, "
                             f"got {n}x{k}")
        codes, scale, minimum = q4_1_groups(weight, self.GROUP)
        tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)  # inner k tiles: the kernel's widest that fits
        if weight.device.type == "cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), tiles)
        else:  # two codes per byte, the even input channel in the high nibble
            packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).contiguous(), tiles)
        self.out_features, self.in_features = n, k
        self.register_buffer("packed", packed)
        zeros = minimum + 8 * scale
        self.register_buffer("scales_and_zeros", torch.stack([scale, zeros], -1).transpose(0, 1).contiguous()
                             .to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @staticmethod
    def supports(shape: tuple[int, int]) -> bool:
        """Whether a weight of `shape` [out, in] fits the kernel's layout."""
        return shape[1] % Int4TinygemmLinear.GROUP == 0 and shape[0] % 8 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        mm = torch._weight_int4pack_mm_for_cpu if self.packed.device.type == "cpu" else torch._weight_int4pack_mm
        y = mm(x2, self.packed, self.GROUP, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.GROUP}, tinygemm"


class Int8Embedding(nn.Module):
    """Token embedding table in int8, groups of 32 values with one fp32 scale each (the GGUF Q8_0
    layout): a quarter of the fp32 table's memory (SmolLM2-135M: 31 MB against 113 MB); looked-up
    rows are dequantized, the table never is.

    w[v, k] = code[v, k] * scale[v, k // 32], scale = max |w| / 127 of the group (Q8_0's rule),
    so a table that came from a Q8_0 file (values code * fp16 scale) is stored exactly: its rows come
    back bit for bit. Buffers in the CPU int8 kernel's layout (`pack_int8`), which a tied `Int8Linear`
    head shares: qweight [ceil(num_embeddings / 16), embedding_dim / 4, 64] int8, scales
    [ceil(num_embeddings / 16), embedding_dim / 32, 16] fp32.

    forward(ids [...] int64) -> [..., embedding_dim] in the scales' dtype.

    Raises (constructor): ValueError if embedding_dim is not a multiple of 32 (`supports`).
    """

    GROUP = 32

    def __init__(self, weight: torch.Tensor):
        """Quantize a float table [num_embeddings, embedding_dim] (it is not modified)."""
        super().__init__()
        self._store(*self._quantized(*weight.shape, lambda a, b: weight[a:b], weight.device), weight.shape)

    @classmethod
    def from_rows(cls, num_embeddings: int, embedding_dim: int, rows: Callable[[int, int], torch.Tensor],
                  device=None) -> "Int8Embedding":
        """A table given by row blocks: `rows(a, b)` -> float [b - a, embedding_dim] (rows a..b-1, e.g.
        dequantized from a file), so no float copy of the whole table is needed."""
        layer = _bare(cls)
        layer._store(*cls._quantized(num_embeddings, embedding_dim, rows, device), (num_embeddings, embedding_dim))
        return layer

    @classmethod
    def _quantized(cls, n: int, k: int, rows: Callable[[int, int], torch.Tensor], device) -> tuple:
        if not cls.supports((n, k)):
            raise ValueError(f"Int8Embedding needs embedding_dim divisible by {cls.GROUP}, got {k}")
        return int8_groups(n, k, rows, cls.GROUP, device, packed=True)

    def _store(self, qweight: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int]) -> None:
        self.num_embeddings, self.embedding_dim = shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @classmethod
    def empty(cls, embedding: nn.Embedding) -> "Int8Embedding":
        """An uninitialised CPU table of `embedding`'s shape (`embedding` may be on the meta device), for
        `load_state_dict` to fill (the quantized weights cache, `tokenspeed.weights`)."""
        n, k = embedding.weight.shape
        layer = _bare(cls)
        blocks = -(-n // 16)
        layer._store(torch.empty(blocks, k // 4, 64, dtype=torch.int8), torch.empty(blocks, k // cls.GROUP, 16), (n, k))
        return layer

    @staticmethod
    def supports(shape: tuple[int, int]) -> bool:
        """Whether a table of `shape` [num_embeddings, embedding_dim] fits the layout."""
        return shape[1] % Int8Embedding.GROUP == 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, s = unpack_int8(self.qweight, self.scales, self.num_embeddings, self.embedding_dim, ids.reshape(-1))
        w = q.to(s.dtype).unflatten(-1, (-1, self.GROUP)) * s[..., None]  # [R, dim / 32, 32]
        return w.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 groups of {self.GROUP}"


def q6k_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """fp32 weights of Q6_K blocks (ggml's block_q6_K: ql [128] low 4 bits, qh [64] high 2 bits, int8
    scales [16] (one per 16 weights), fp16 d): w = d * scale * (code - 32), in the arithmetic of
    `gguf.quants.Q6_K.dequantize_blocks` (d * scale in fp32, then times the code), so the values equal
    its bit for bit.

    Args:
        blocks: [..., B * 210] uint8, whole blocks along the last axis (a row of a GGUF tensor).
    Returns:
        [..., B * 256] fp32.
    Raises:
        ValueError: the last axis is not a whole number of blocks.
    """
    lead, b = _whole_blocks(blocks, Q6_K)
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:]
    scale = d.contiguous().view(torch.float16).float() * sc.contiguous().view(torch.int8).float()  # [n, 16]
    lo = torch.stack([ql & 15, ql >> 4], 1).reshape(-1, 2, 2, 64).transpose(1, 2).reshape(-1, 2, 4, 32)
    hi = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 1).reshape(-1, 4, 2, 32).transpose(1, 2)
    codes = ((lo | (hi << 4)).to(torch.int8) - 32).float().reshape(-1, 16, 16)
    return (scale[..., None] * codes).reshape(*lead, -1)


def q5_0_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """fp32 weights of Q5_0 blocks (ggml's block_q5_0: fp16 d, qh [4] (bit i of the little-endian
    uint32: weight i's fifth bit), qs [16] (weight l's low 4 bits in qs[l]'s low nibble, weight
    16 + l's in its high nibble)): w = d * (code - 16), codes 0..31, in the arithmetic of
    `gguf.quants.Q5_0.dequantize_blocks`, so the values equal its bit for bit.

    Args:
        blocks: [..., B * 22] uint8, whole blocks along the last axis (a row of a GGUF tensor).
    Returns:
        [..., B * 32] fp32.
    Raises:
        ValueError: the last axis is not a whole number of blocks.
    """
    lead, b = _whole_blocks(blocks, Q5_0)
    d, qh, qs = b[:, :2].contiguous().view(torch.float16).float(), b[:, 2:6], b[:, 6:]
    hi = (qh[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [n, 4, 8]: bit i = byte i / 8, bit i % 8
    codes = torch.cat([qs & 15, qs >> 4], 1) | (hi.reshape(-1, 32) << 4)
    return (d * (codes.to(torch.int8) - 16).float()).reshape(*lead, -1)


_Q5_0_HELD = 16 * 22  # bytes per 16 rows and block of 32 in `pack_q5_0`'s layout


def _swap_fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    # [.., G, 4] uint8 fifth-bit words: bit 8o + 4h + i <-> bit 8i + 4h + o (ggml's order <-> pack_q5_0's; its own
    # inverse)
    bits = ((qh[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).view(*qh.shape[:-1], 4, 2, 4)
    return (bits.transpose(-3, -1).reshape(*qh.shape, 8) << torch.arange(8, dtype=torch.uint8)).sum(-1).to(torch.uint8)


def _interleave_q5_0(b: torch.Tensor) -> torch.Tensor:
    # [16 m, G, 22] uint8 Q5_0 blocks -> [m, G, 352] (pack_q5_0)
    m, g = b.shape[0] // 16, b.shape[1]
    d, qh, qs = b[..., :2], b[..., 2:6], b[..., 6:]
    low = torch.cat([qs & 15, qs >> 4], -1).view(-1, g, 4, 2, 4)  # [.., octet o, half h, byte i]: weight 8o + 4h + i
    nib = low[..., 0, :] | (low[..., 1, :] << 4)  # [.., o, i]
    word = _swap_fifth_bits(qh)
    return torch.cat([nib.view(m, 16, g, 4, 4).permute(0, 2, 3, 1, 4).reshape(m, g, 256),
                      word.view(m, 16, g, 4).transpose(1, 2).reshape(m, g, 64),
                      d.reshape(m, 16, g, 2).transpose(1, 2).reshape(m, g, 32)], -1)


def pack_q5_0(blocks: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """Rows of Q5_0 blocks as stored (ggml's block_q5_0) -> the CPU kernel's layout, interleaved by 16 output
    rows (`q5_0_gemv`, cpu_kernels.h `ts_q5_0_rows`): [ceil(N / 16), G, 352] uint8, 22 bytes per row and block,
    as stored. Per block of rows b and group g: the low 4 bits, byte 64 o + 4 j + i holding row 16 b + j's
    weight 8 o + i in its low nibble and 8 o + 4 + i in its high one; then the fifth bits, one little-endian
    uint32 per row j, bit 8 i + 4 h + o = weight 8 o + 4 h + i's; then d, one fp16 per row. Rows past N are
    zero blocks (d = 0). Made `chunk_rows` rows at a time (temporaries of a few times their bytes).

    Args:
        blocks: [N, G * 22] uint8.
    Returns:
        [ceil(N / 16), G, 352] uint8.
    Raises:
        ValueError: the rows are not whole blocks.
    """
    _whole_blocks(blocks, Q5_0)
    n, g = blocks.shape[0], blocks.shape[-1] // Q5_0.nbytes
    b = blocks.reshape(n, g, Q5_0.nbytes)
    out = torch.empty(-(-n // 16), g, _Q5_0_HELD, dtype=torch.uint8)
    step = max(16, chunk_rows // 16 * 16)
    for r in range(0, n, step):
        part = b[r:r + step]
        out[r // 16:r // 16 + -(-part.shape[0] // 16)] = _interleave_q5_0(F.pad(part, (0, 0, 0, 0, 0, -part.shape[0] % 16)))
    return out


def unpack_q5_0(held: torch.Tensor, n: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`pack_q5_0`'s inverse for a weight of `n` rows: the Q5_0 blocks as stored [R, G * 22] uint8 of the rows
    `rows` ([R] int64; None: all n)."""
    nb, g, _ = held.shape
    rows = torch.arange(n) if rows is None else rows
    b, lane = rows // 16, rows % 16
    nib = held[..., :256].view(nb, g, 4, 16, 4)[b, :, :, lane]  # [R, G, o, i]
    word = held[..., 256:320].view(nb, g, 16, 4)[b, :, lane]  # [R, G, 4 bytes]
    d = held[..., 320:].view(nb, g, 16, 2)[b, :, lane]
    low = torch.stack([nib & 15, nib >> 4], -2).view(-1, g, 32)  # weight 8o + 4h + i
    return torch.cat([d, _swap_fifth_bits(word), low[..., :16] | (low[..., 16:] << 4)], -1).reshape(-1, g * Q5_0.nbytes)


def _k_scale_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Q4_K / Q5_K super-blocks b [n, >= 16 bytes] -> fp16 d and dmin [n, 1], 6-bit sc and m [n, 8] uint8
    # (ggml's get_scale_min_k4)
    d, dmin = (b[:, i:i + 2].contiguous().view(torch.float16) for i in (0, 2))
    lo, hi, mix = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    sc = torch.cat([lo & 63, (mix & 15) | ((lo >> 6) << 4)], 1)
    m = torch.cat([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], 1)
    return d, dmin, sc, m


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # [n, 8] fp32 d * sc and dmin * m of Q4_K / Q5_K super-blocks b [n, >= 16 bytes]
    d, dmin, sc, m = _k_scale_parts(b)
    return d.float() * sc.float(), dmin.float() * m.float()


def qk_dequantize(blocks: torch.Tensor, fifth_bit: bool) -> torch.Tensor:
    """fp32 weights of Q4_K (`fifth_bit` False) or Q5_K blocks (ggml's block_q4_K / block_q5_K: 256 weights
    as 8 sub-blocks of 32; fp16 d and dmin, 12 bytes packing a 6-bit scale sc and minimum m per sub-block,
    Q5_K's qh [32] fifth bits, qs [128] low 4 bits): w = (d sc) code - (dmin m), in the arithmetic of
    `gguf.quants.Q4_K` / `Q5_K.dequantize_blocks` (both products in fp32, then the difference), so the
    values equal theirs bit for bit.

    Args:
        blocks: [..., B * 144] (Q4_K) or [..., B * 176] (Q5_K) uint8, whole blocks along the last axis.
    Returns:
        [..., B * 256] fp32.
    Raises:
        ValueError: the last axis is not a whole number of blocks.
    """
    lead, b = _whole_blocks(blocks, Q5_K if fifth_bit else Q4_K)
    ds, dm = _k_scales(b)
    qs = b[:, -128:].reshape(-1, 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], 2).reshape(-1, 8, 32)  # sub-block 2c: low nibbles of run c
    if fifth_bit:
        qh = b[:, 16:48]
        codes = codes | (((qh[:, None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1) << 4)
    return (ds[..., None] * codes.float() - dm[..., None]).reshape(*lead, -1)


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block type the engine runs in its own format: its name (the file's tensor type), its ggml type
    number (the fused extension's `block_gemv` takes it), weights and bytes per block, the dequantization
    (equal to `gguf.quants.dequantize` bit for bit), the input channels per int8 activation scale of its
    kernel (32 for Q5_0; 256 for Q4_K, Q5_K and Q6_K, as llama.cpp's Q8_K, so a block's sums stay integers),
    and how a layer holds its blocks: as stored ([N, K / values * bytes]; `pack` None) or interleaved by 16
    rows for its kernel (`pack` [N, ...] -> [ceil(N / 16), K / values, 16 * bytes], `unpack` (held, N, rows)
    -> the rows as stored: Q5_0's `pack_q5_0`, `unpack_q5_0`)."""
    name: str
    ggml_type: int
    values: int
    nbytes: int
    dequantize: Callable[[torch.Tensor], torch.Tensor]
    act_group: int = 32
    pack: Callable[[torch.Tensor], torch.Tensor] | None = None
    unpack: Callable[..., torch.Tensor] | None = None

    def held_shape(self, n: int, k: int) -> tuple[int, ...]:
        """The shape of the uint8 tensor a layer holds for an [n, k] weight."""
        if self.pack is None:
            return n, k // self.values * self.nbytes
        return -(-n // 16), k // self.values, 16 * self.nbytes

    def held(self, blocks: torch.Tensor) -> torch.Tensor:
        """Rows of blocks as stored [n, K / values * bytes] -> what a layer holds."""
        return blocks if self.pack is None else self.pack(blocks)

    def rows_of(self, held: torch.Tensor, n: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks as stored [R, K / values * bytes] of the rows `rows` ([R] int64; None: all n) of what a
        layer of n rows holds."""
        if self.pack is None:
            return held if rows is None else held[rows]
        return self.unpack(held, n, rows)


def _whole_blocks(blocks: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Size, torch.Tensor]:
    # (leading shape, [n, nbytes] blocks) of rows of whole blocks; ValueError otherwise
    if blocks.shape[-1] % fmt.nbytes:
        raise ValueError(f"{fmt.name} rows of {blocks.shape[-1]} bytes are not whole blocks of {fmt.nbytes}")
    return blocks.shape[:-1], blocks.reshape(-1, fmt.nbytes)


# ggml type numbers: ggml.h's enum ggml_type (gguf.GGMLQuantizationType)
Q5_0 = BlockFormat("Q5_0", 6, 32, 22, q5_0_dequantize, pack=pack_q5_0, unpack=unpack_q5_0)
Q4_K = BlockFormat("Q4_K", 12, 256, 144, functools.partial(qk_dequantize, fifth_bit=False), act_group=256)
Q5_K = BlockFormat("Q5_K", 13, 256, 176, functools.partial(qk_dequantize, fifth_bit=True), act_group=256)
Q6_K = BlockFormat("Q6_K", 14, 256, 210, q6k_dequantize, act_group=256)


class BlockLinear(nn.Module):
    """Linear layer over a GGUF file's blocks in the block format `FORMAT` (a subclass per format:
    `Q4KLinear`, `Q5KLinear`, `Q6KLinear`, `Q5_0Linear`).

    Buffers: blocks uint8 of `FORMAT.held_shape`: [out, in / FORMAT.values * FORMAT.nbytes] as stored (row n:
    its blocks), or Q5_0's interleaved by 16 rows ([ceil(out / 16), in / 32, 352], `pack_q5_0`); `rows_of`
    gives them as stored either way. bias [out] or None.
    forward(x [..., in]) -> [..., out] in x's dtype. On the CPU the fused extension's `block_gemv` (Q5_0:
    `q5_0_gemv`) runs it with the format's kernel: each row's activations quantized to int8 per group of `FORMAT.act_group`
    (scale max|x| / 127) and multiplied with the codes in int32 per block or sub-block, scaled by the block's
    scales and the group's activation scale (a row's result does not depend on the other rows in the
    call). Without the extension the same arithmetic runs in torch (`reference`). A projection that
    mixes block types (Q4_K_M's fused q/k/v with a Q6_K or Q8_0 v) is a `StackedLinear` of one layer per
    type (`tokenspeed.weights.load_gguf`).

    Raises (constructors): ValueError if the blocks are not uint8 [out, whole blocks].
    """

    FORMAT: BlockFormat

    def __init__(self, blocks: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        fmt = self.FORMAT
        if blocks.dim() != 2 or blocks.dtype != torch.uint8 or blocks.shape[1] % fmt.nbytes:
            raise ValueError(f"{type(self).__name__} needs uint8 blocks [out, in / {fmt.values} * {fmt.nbytes}], "
                             f"got {blocks.dtype} {tuple(blocks.shape)}")
        self._store(fmt.held(blocks), bias, shape=(blocks.shape[0], blocks.shape[1] // fmt.nbytes * fmt.values))

    def _store(self, blocks: torch.Tensor, bias: torch.Tensor | None, shape: tuple[int, int]) -> None:
        self.out_features, self.in_features = shape
        self.register_buffer("blocks", blocks)
        self.register_buffer("bias", bias)

    @classmethod
    def tied(cls, embedding: "BlockEmbedding") -> "BlockLinear":
        """The lm_head of a model that ties it to its `BlockEmbedding` of the same format: the table's own
        blocks (the same tensor, no copy): the model holds the tied weight once. No bias."""
        layer = _bare(cls)
        layer._store(embedding.blocks, None, shape=(embedding.num_embeddings, embedding.embedding_dim))
        return layer

    @classmethod
    def empty(cls, linear: nn.Linear) -> "BlockLinear":
        """An uninitialised CPU layer of `linear`'s shape (`linear` may be on the meta device), for
        `load_state_dict` to fill (the quantized weights cache, `tokenspeed.weights`)."""
        n, k = linear.weight.shape
        return _uninitialised(cls, linear, torch.empty(cls.FORMAT.held_shape(n, k), dtype=torch.uint8), shape=(n, k))

    @classmethod
    def supports(cls, shape: tuple[int, int]) -> bool:
        """Whether a weight of `shape` [out, in] is whole blocks per row."""
        return shape[1] % cls.FORMAT.values == 0

    def rows_of(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks as stored [R, in / FORMAT.values * FORMAT.nbytes] uint8 of the output rows `rows` ([R]
        int64; None: all), whatever the layout."""
        return self.FORMAT.rows_of(self.blocks, self.out_features, rows)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight as [out, in] fp32 (or only the output rows `rows` [R] int64, [R, in])."""
        return self.FORMAT.dequantize(self.rows_of(rows))

    def reference(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] fp32 -> [M, out] fp32 (or only the output rows `rows` [R] int64: [M, R]; bias not
        added): the arithmetic of the format's kernel in torch, x quantized per group of `FORMAT.act_group`
        as the kernel does, products with the dequantized weights in float64 (the kernel's sums are exact per
        block or sub-block, so the two agree to fp32 rounding)."""
        m = x.shape[0]
        xg = x.float().reshape(m, -1, self.FORMAT.act_group)
        amax = xg.abs().amax(-1, keepdim=True)
        q = torch.round(xg * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
        return ((q * (amax / 127)).reshape(m, -1).double() @ self.dequantized(rows).double().T).float()

    def gemv(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] fp32 -> [M, out] fp32 (or only the output rows `rows` [R] int64: [M, R]; bias not
        added): the format's kernel on the CPU when the extension is built, `reference` otherwise."""
        ext = fused_ext() if x.device.type == "cpu" else None
        if ext is None:
            return self.reference(x, rows)
        if self.FORMAT.pack is None:
            return ext.block_gemv(x, self.blocks if rows is None else self.blocks.index_select(0, rows),
                                  self.FORMAT.ggml_type)
        # Q5_0 interleaved (the selected rows packed for the kernel; each row's lanes computed as in the whole layer)
        held = self.blocks if rows is None else self.FORMAT.pack(self.rows_of(rows))
        return ext.q5_0_gemv(x, held)[:, :self.out_features if rows is None else rows.numel()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.gemv(x.reshape(-1, self.in_features).float())
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.FORMAT.name} blocks, "
                "int8 activations")


class Q4KLinear(BlockLinear):
    """`BlockLinear` over Q4_K blocks (ggml's block_q4_K: 256 weights in 144 bytes, 4.5 bits each; most
    projections of a Q4_K_M file): w = (d sc) code - (dmin m) per sub-block of 32, codes 0..15
    (`qk_dequantize`); W4A8, the minimums subtracted once per sub-block through the activations' group
    sums."""

    FORMAT = Q4_K


class Q5KLinear(BlockLinear):
    """`BlockLinear` over Q5_K blocks (ggml's block_q5_K: 256 weights in 176 bytes, 5.5 bits each; most
    projections of a Q5_K_M file): Q4_K with a fifth bit per code, codes 0..31 (`qk_dequantize`); W5A8."""

    FORMAT = Q5_K


class Q6KLinear(BlockLinear):
    """`BlockLinear` over Q6_K blocks (ggml's block_q6_K: 256 weights in 210 bytes, 6.5625 bits each; the
    tied head/embedding and part of attn_v/ffn_down of a Q4_K_M file): w[n, k] = d * scale(k / 16) *
    (code - 32), codes 0..63 (`q6k_dequantize`); W6A8, the bias of 32 subtracted once per run of 16
    weights."""

    FORMAT = Q6_K


class Q5_0Linear(BlockLinear):
    """`BlockLinear` over Q5_0 blocks (ggml's block_q5_0: 32 weights in 22 bytes, 5.5 bits each; most of a
    Q4_K_M file whose rows are not whole 256-blocks, e.g. Qwen2.5-0.5B's hidden size 896):
    w[n, k] = d * (code - 16), codes 0..31 (`q5_0_dequantize`); held interleaved by 16 rows (`pack_q5_0`, the
    same bytes) for `q5_0_gemv`: W5A8, one dot product per 4 input channels of 16 rows, the bias of 16
    subtracted exactly in int32 through the activations' group sums."""

    FORMAT = Q5_0


class BlockEmbedding(nn.Module):
    """Token embedding table held as a GGUF file's blocks in the format `FORMAT` (a subclass per format):
    looked-up rows are dequantized (equal to `gguf.quants.dequantize`'s rows bit for bit), the table never
    is; a tied head (`BlockLinear.tied` of the same format) runs the same blocks.

    Buffers: blocks uint8 of `FORMAT.held_shape` (as `BlockLinear`'s: as stored, or Q5_0's interleaved).
    forward(ids [...] int64) -> [..., embedding_dim] fp32.

    Raises (constructor): ValueError if the blocks are not uint8 [num_embeddings, whole blocks].
    """

    FORMAT: BlockFormat

    def __init__(self, blocks: torch.Tensor):
        super().__init__()
        fmt = self.FORMAT
        if blocks.dim() != 2 or blocks.dtype != torch.uint8 or blocks.shape[1] % fmt.nbytes:
            raise ValueError(f"{type(self).__name__} needs uint8 blocks [num_embeddings, dim / {fmt.values} * "
                             f"{fmt.nbytes}], got {blocks.dtype} {tuple(blocks.shape)}")
        self._store(fmt.held(blocks), (blocks.shape[0], blocks.shape[1] // fmt.nbytes * fmt.values))

    def _store(self, blocks: torch.Tensor, shape: tuple[int, int]) -> None:
        self.num_embeddings, self.embedding_dim = shape
        self.register_buffer("blocks", blocks)

    @classmethod
    def empty(cls, embedding: nn.Embedding) -> "BlockEmbedding":
        """An uninitialised CPU table of `embedding`'s shape (`embedding` may be on the meta device), for
        `load_state_dict` to fill (the quantized weights cache, `tokenspeed.weights`)."""
        n, k = embedding.weight.shape
        layer = _bare(cls)
        layer._store(torch.empty(cls.FORMAT.held_shape(n, k), dtype=torch.uint8), (n, k))
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.FORMAT.rows_of(self.blocks, self.num_embeddings, ids.reshape(-1))
        return self.FORMAT.dequantize(rows).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.FORMAT.name} blocks"


class Q4KEmbedding(BlockEmbedding):
    """`BlockEmbedding` of Q4_K blocks (the `token_embd.weight` of a Q4_K_M file with an untied head)."""

    FORMAT = Q4_K


class Q5KEmbedding(BlockEmbedding):
    """`BlockEmbedding` of Q5_K blocks (the `token_embd.weight` of a Q5_K_M file with an untied head)."""

    FORMAT = Q5_K


class Q6KEmbedding(BlockEmbedding):
    """`BlockEmbedding` of Q6_K blocks (a Q4_K_M file's `token_embd.weight` when the hidden size is a
    multiple of 256)."""

    FORMAT = Q6_K


class Q5_0Embedding(BlockEmbedding):
    """`BlockEmbedding` of Q5_0 blocks (a Q5_0 file's `token_embd.weight`)."""

    FORMAT = Q5_0


class StackedLinear(nn.Module):
    """One projection whose output rows come from parts of different formats, stacked: a fused q/k/v whose
    tensors a GGUF file stores in different block formats (Q4_K_M's Q4_K q and k with a Q6_K v), each part
    kept in its own format instead of all converted to a common one.

    forward(x [..., in]) -> [..., sum of the parts' out_features]: the parts' outputs concatenated in order.

    Raises (constructor): ValueError if the parts' in_features differ or there are fewer than two.
    """

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        if len(parts) < 2 or len({p.in_features for p in parts}) != 1:
            raise ValueError("StackedLinear needs two or more parts of the same in_features, got "
                             f"{[(p.out_features, p.in_features) for p in parts]}")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None  # each part carries its own

    @classmethod
    def empty(cls, linear: nn.Linear, rows: list[int]) -> "StackedLinear":
        """Placeholder parts of `rows` output rows each ([in] from `linear`, meta device), for the quantized
        weights cache to replace with the saved layers (`tokenspeed.weights.load_quantized`)."""
        k, bias = linear.weight.shape[1], linear.bias is not None
        return cls([nn.Linear(k, r, bias=bias, device="meta") for r in rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


# the block formats run as stored, by GGUF tensor type: their linear and embedding classes
BLOCK_LINEARS = {cls.FORMAT.name: cls for cls in (Q4KLinear, Q5KLinear, Q6KLinear, Q5_0Linear)}
BLOCK_EMBEDDINGS = {cls.FORMAT.name: cls for cls in (Q4KEmbedding, Q5KEmbedding, Q6KEmbedding, Q5_0Embedding)}


QUANTIZED = (Int8Linear, Int4Linear, Int4TinygemmLinear, BlockLinear)  # quantized layer types (`quantize`, `load_gguf`)


def linear_bytes(model: nn.Module) -> int:
    """Bytes of every projection of `model` (nn.Linear or a quantized layer, a shared weight once,
    buffers such as scales included): what one decode step reads of its weights. Embeddings are
    gathered, one row per token, and not counted."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, (nn.Linear, *QUANTIZED)):
            for t in [*m._parameters.values(), *m._buffers.values()]:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    return total


def fused_ext(verbose: bool = False):
    """The fused CPU decode extension for the variant in force (`tokenspeed.kernels.cpu_decode.load`,
    built into the engine's cache folder on first use), or None where it cannot be built.

    Raises:
        ValueError: `$TOKENSPEED_CPU_ISA` names an unknown variant or one this CPU cannot run.
    """
    from .kernels.cpu_decode import load
    from .paths import cache_dir

    return load(cache_dir(), verbose=verbose)


def linear_rows(linear: nn.Module, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Project x [M, in] onto the output rows `rows` [K] int64 of an `nn.Linear`, `Int8Linear` or `BlockLinear`.

    Returns [M, K] fp32. Reads K rows of the weight instead of all of them (lm_head logits for
    the token ids a grammar allows); an `Int8Linear` (`BlockLinear`) on the CPU runs the same W8A8 (block
    format's) kernel as its `forward` (`int8_gemv`, `block_gemv`), so the selected logits equal the
    full head's columns.

    Raises:
        TypeError: `linear` is neither an `nn.Linear` nor an `Int8Linear` nor a `BlockLinear`.
    """
    ext = fused_ext() if isinstance(linear, Int8Linear) and linear.qweight.dim() == 3 and x.device.type == "cpu" else None
    if isinstance(linear, BlockLinear):
        y = linear.gemv(x.float(), rows)
    elif ext is not None:  # the rows packed as the kernel takes them (each row's lanes computed as in the whole head)
        y = ext.int8_gemv(x.float(), *pack_int8(*linear.rows_of(rows)))[:, :rows.numel()]
    elif isinstance(linear, Int8Linear):
        y = F.linear(x.float(), linear.dequantized(torch.float32, rows))
    elif isinstance(linear, nn.Linear):
        y = F.linear(x, linear.weight.index_select(0, rows)).float()
    else:
        raise TypeError(f"linear_rows needs an nn.Linear, Int8Linear or BlockLinear, got {type(linear).__name__}")
    if linear.bias is not None:
        y = y + linear.bias.index_select(0, rows).float()
    return y


def quantize(model: nn.Module, mode: str = "int8", empty: bool = False) -> nn.Module:
    """Replace every `nn.Linear` inside `model` (in place) with its quantized version, and on the CPU
    its token embedding table (`model.tok_embeddings`, an `nn.Embedding`) with an `Int8Embedding`
    (a quantized head never shares the float table, so keeping it would only cost memory; elsewhere
    the table stays float). A head tied to that table (`model.output`, the same weight) becomes
    `Int8Linear.tied` to the `Int8Embedding`: its int8 groups, held once, in either mode.

    Call it after moving the model to its device and dtype.

    Args:
        model: a `tokenspeed.Transformer` (any module works).
        mode: "int8" (every linear `Int8Linear`) or "int4" (where the shape fits, `Int4Linear` on the
            CPU and `Int4TinygemmLinear` on other devices; the lm_head - a child named "output" - and
            any other linear `Int8Linear`, per output channel unless tied as above).
        empty: uninitialised layers of the same shapes instead (`Int4Linear.empty`; the model may be
            on the meta device; inside `torch.device("meta")` the layers are on meta too and take no
            memory), for `load_state_dict(..., assign=True)` to fill with weights quantized earlier.
    Returns:
        the same model.
    Raises:
        ValueError: unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {MODES}")
    emb = getattr(model, "tok_embeddings", None)
    if (isinstance(emb, nn.Embedding) and (empty or emb.weight.device.type == "cpu")
            and Int8Embedding.supports(emb.weight.shape)):
        # (scales in the table's dtype: rows come out in the activations' dtype)
        model.tok_embeddings = Int8Embedding.empty(emb) if empty else Int8Embedding(emb.weight).to(emb.weight.dtype)
        head = getattr(model, "output", None)
        if (isinstance(head, nn.Linear) and head.weight is emb.weight and head.bias is None
                and model.tok_embeddings.scales.dtype == torch.float32):  # the grouped kernel's scales
            model.output = Int8Linear.tied(model.tok_embeddings)  # tied: the table's int8 groups, no copy
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            int4 = Int4Linear if empty or child.weight.device.type == "cpu" else Int4TinygemmLinear
            cls = int4 if mode == "int4" and name != "output" and int4.supports(child.weight.shape) else Int8Linear
            setattr(parent, name, cls.empty(child) if empty else cls(child.weight, child.bias))
    if hasattr(model, "invalidate_fused"):
        model.invalidate_fused()
    return model


# ---- quantize="auto": the measured choice of weight format
#
# A turn of an agent is roughly one short observation's prefill and a decision's few dozen decoded
# tokens, so a format's cost is DECODE_STEPS one-token steps plus one PREFILL_ROWS-token chunk.
DECODE_STEPS, PREFILL_ROWS, PROBE_TOKENS = 32, 128, 6
_AUTO_CACHE_VERSION = 1


@dataclass
class FormatChoice:
    """The weight format `quantize="auto"` picked and the measurements behind it.

    Attributes:
        format: "fp32", "int8" or "int4".
        timings: format -> {"decode_ms": median one-token decode step, "prefill_ms": median
            `PREFILL_ROWS`-token prefill chunk, "cost_ms": DECODE_STEPS * decode_ms + prefill_ms,
            "agrees": greedy tokens on the probe set equal fp32's} (ms, this process's threads).
        variant: the CPU kernel variant in force (`tokenspeed.kernels.cpu_decode`).
        cached: the choice came from the cache (no timing at this load).
    """

    format: str
    timings: dict = field(default_factory=dict)
    variant: str = ""
    cached: bool = False

    def describe(self) -> str:
        """One line: the choice, the variant and each format's cost (for logs and reports)."""
        parts = [f"{f} {t['cost_ms']:.0f} ms" + ("" if t["agrees"] else " (disagrees with fp32)")
                 for f, t in self.timings.items()]
        return (f"auto weights: {self.format} on {self.variant or 'no fused kernels'} "
                f"({'cached' if self.cached else 'measured'}; {DECODE_STEPS} decode steps + {PREFILL_ROWS}-token "
                f"prefill: {', '.join(parts)})")


def _greedy(model: nn.Module, ids: list[int], n: int) -> list[int]:
    cache = model.new_cache(len(ids) + n + 1)
    logits = model(torch.tensor(ids), torch.arange(len(ids)), cache, "last")
    out = []
    for i in range(n):
        out.append(int(logits[-1].argmax()))
        pos = len(ids) + i
        logits = model(torch.tensor(out[-1:]), torch.tensor([pos]), cache, "last")
    return out


def _time_format(model: nn.Module, repeats: int = 5) -> tuple[float, float]:
    """(median decode step ms at a 64-token context, median PREFILL_ROWS-token prefill ms)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.args.vocab_size, (64 + PREFILL_ROWS + repeats + 1,), generator=gen)
    cache = model.new_cache(len(ids) + PREFILL_ROWS * repeats)
    model(ids[:64], torch.arange(64), cache, "none")
    decode = []
    for i in range(repeats + 1):  # the first step warms up
        t0 = time.perf_counter()
        model(ids[64 + i:65 + i], torch.tensor([64 + i]), cache, "last")
        decode.append(time.perf_counter() - t0)
    prefill = []
    for _ in range(2):
        cache.n = 64
        t0 = time.perf_counter()
        model(ids[:PREFILL_ROWS], torch.arange(64, 64 + PREFILL_ROWS), cache, "last")
        prefill.append(time.perf_counter() - t0)
    return statistics.median(decode[1:]) * 1e3, min(prefill) * 1e3


def _auto_key(probes: list[list[int]], identity: str) -> str:
    from .kernels.cpu_decode import cpu_features, selected_variant

    return hashlib.sha256(json.dumps([_AUTO_CACHE_VERSION, platform.machine(), sorted(cpu_features()),
                                      selected_variant(), torch.__version__, torch.get_num_threads(), identity,
                                      probes]).encode()).hexdigest()


def _read_choices(cache_file: Path) -> dict:
    try:
        return json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}


def cached_format(probes: list[list[int]], identity: str, cache_file: Path) -> FormatChoice | None:
    """The choice `choose_format` made earlier for this machine, model and probe set (`cached`
    True), or None; lets a load read weights already in the chosen format. Arguments as
    `choose_format`'s."""
    known = _read_choices(cache_file).get(_auto_key(probes, identity))
    return None if known is None else FormatChoice(**{**known, "cached": True})


def choose_format(model: nn.Module, probes: list[list[int]], identity: str,
                  cache_file: Path) -> tuple[nn.Module, FormatChoice]:
    """Pick the fastest weight format whose greedy tokens agree with fp32's, and return the model in it.

    Each format in `FORMATS` is timed on this machine (`_time_format`: a decode step and a prefill
    chunk, about a second per format) and greedy-decodes `PROBE_TOKENS` tokens after each probe;
    the cheapest format (DECODE_STEPS decode steps + one prefill chunk) whose tokens equal fp32's
    wins, so the pick is never slower than fp32 in its own timing. The choice and timings are
    cached in `cache_file` per machine (CPU features, kernel variant, torch threads), model
    `identity` and probe set; a cached choice costs only the quantization.

    Args:
        model: a fp32 `Transformer` on the CPU (quantized in place when int8/int4 wins).
        probes: token-id lists (prompts) for the agreement check.
        identity: names the model's weights (e.g. its converted folder).
        cache_file: JSON file holding earlier choices.
    Returns:
        (the model in the chosen format, the `FormatChoice`).
    """
    from .kernels.cpu_decode import selected_variant

    choice = cached_format(probes, identity, cache_file)
    if choice is not None:
        if choice.format != "fp32":
            quantize(model, choice.format)
        log.info("%s", choice.describe())
        return model, choice
    variant = selected_variant()
    log.info("auto weights: measuring %s on this machine, once (about 10-60 s on two cores; cached in %s)",
             ", ".join(FORMATS), cache_file)
    timings, models, reference = {}, {}, None
    for fmt in FORMATS:
        if fmt != "fp32":
            model.invalidate_fused()  # the fused step's handle to the extension does not copy
        m = model if fmt == "fp32" else quantize(copy.deepcopy(model), fmt)
        tokens = [_greedy(m, ids, PROBE_TOKENS) for ids in probes]
        reference = tokens if fmt == "fp32" else reference
        decode_ms, prefill_ms = _time_format(m)
        timings[fmt] = {"decode_ms": round(decode_ms, 3), "prefill_ms": round(prefill_ms, 3),
                        "cost_ms": round(DECODE_STEPS * decode_ms + prefill_ms, 3), "agrees": tokens == reference}
        models[fmt] = m
    best = min((f for f in timings if timings[f]["agrees"]), key=lambda f: timings[f]["cost_ms"])
    choice = FormatChoice(best, timings, variant)
    known = _read_choices(cache_file)
    known[_auto_key(probes, identity)] = {k: v for k, v in asdict(choice).items() if k != "cached"}
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(cache_file)
    except OSError as exc:
        log.warning("auto weights: choice not cached (%s)", exc)
    log.info("%s", choice.describe())
    return models[best], choice
