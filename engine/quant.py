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

import copy
import hashlib
import json
import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Int8Linear", "Int4Linear", "quantize", "linear_rows", "fused_ext", "choose_format", "cached_format",
           "FormatChoice", "MODES", "FORMATS", "PACKED_ROWS"]

MODES = ("int8", "int4")
FORMATS = ("fp32",) + MODES  # what `choose_format` times: fp32 (no quantization) and each mode
log = logging.getLogger(__name__)
PACKED_ROWS = 32  # rows up to which the packed int8 kernel beats dequantize + GEMM (measured, 2-core CPU)


def _has_int8pack(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def _uninitialised(cls, linear: nn.Linear, *weights: torch.Tensor) -> nn.Module:
    """A `cls` layer holding the uninitialised `weights` (and a bias buffer when `linear` has one),
    for `load_state_dict` to fill; `cls._store` names the buffers."""
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    bias = linear.bias
    layer._store(*weights, None if bias is None else torch.empty(bias.shape[0], dtype=bias.dtype))
    return layer


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
        self._store(q.contiguous(), scales, None if bias is None else bias.detach().clone())

    def _store(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("scales_bf16", scales.to(torch.bfloat16))
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """Quantize an `nn.Linear` (its weight is not modified)."""
        return cls(linear.weight, linear.bias)

    @classmethod
    def empty(cls, linear: nn.Linear) -> "Int8Linear":
        """An uninitialised CPU layer of `linear`'s shape (`linear` may be on the meta device), for
        `load_state_dict` to fill (the quantized weights cache, `tokenspeed.weights`)."""
        n, k = linear.weight.shape
        return _uninitialised(cls, linear, torch.empty(n, k, dtype=torch.int8), torch.empty(n))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as [out, in] of `dtype` (scales applied)."""
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        packed = x2.shape[0] <= PACKED_ROWS and _has_int8pack(x.device)
        if packed and (ext := fused_ext()) is not None:
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
        self._store(*self.pack(codes, scale, lo), None if bias is None else bias.detach().clone())

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
        ext = fused_ext()
        y = ext.int4_matmul(x2, self.codes, self.scales) if ext is not None else self.reference(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.GROUP}, int8 activations"


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


def quantize(model: nn.Module, mode: str = "int8", empty: bool = False) -> nn.Module:
    """Replace every `nn.Linear` inside `model` (in place) with its quantized version.

    Call it after moving the model to its device and dtype.

    Args:
        model: a `tokenspeed.Transformer` (any module works).
        mode: "int8" (every linear `Int8Linear`) or "int4" (`Int4Linear` where the shape fits, the
            lm_head - a child named "output" - and any other linear `Int8Linear`).
        empty: uninitialised CPU layers of the same shapes instead (`Int4Linear.empty`; the model may be
            on the meta device), for `load_state_dict` to fill with weights quantized earlier.
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
            if mode == "int4" and not empty and child.weight.device.type != "cpu":
                raise ValueError("int4 quantization runs on the CPU only; use int8 or the float model on this device")
            cls = Int4Linear if mode == "int4" and name != "output" and Int4Linear.supports(child.weight.shape) \
                else Int8Linear
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


def choose_format(model: nn.Module, probes: list[list[int]], identity: str, cache_file: Path) -> tuple[nn.Module, FormatChoice]:
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
    best = min((f for f in FORMATS if timings[f]["agrees"]), key=lambda f: timings[f]["cost_ms"])
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
