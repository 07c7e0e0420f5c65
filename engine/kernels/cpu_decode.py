"""Fused CPU decode step: every decoder layer for a few new tokens in one C++ call.

`cpu_decode.cpp` runs the layer math of the Python path (RMSNorm, QKV, Qwen3's per-head Q/K
RMSNorm, rotary except in SmolLM3's NoPE layers, KV-cache write (fp16 or fp32), grouped-query attention, output
projection, SwiGLU) as loops around the same kernels, with the
GIL released, so that a decode step pays no per-op framework dispatch (`tokenspeed bench profile`
shows that cost). The numerical kernels (`cpu_kernels.cpp`, a torch-free C ABI: the W4A8
`int4_matmul`, the W8A8 `int8_gemv`, `block_gemv` over GGUF blocks as stored and `q5_0_gemv`) are written once over a
thin ISA layer (`cpu_isa.h`)
and compiled for one variant (`VARIANTS`): the best this CPU runs, or `TOKENSPEED_CPU_ISA`.
The build goes to `<cache>/ext/<variant>-<hash>`, the hash covering sources, torch, flags and the
CPU's feature set, so a shared cache never loads a build the CPU cannot run. Without a compiler
`load()` returns None and the model keeps its Python path. Imports nothing of the engine.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["load", "FusedDecode", "FUSED_ROWS", "FUSED_PREFILL_ROWS", "VARIANTS", "Variant", "cpu_features",
           "native_variant", "selected_variant", "ISA_ENV", "SOURCES"]

# Forwards of at most FUSED_PREFILL_ROWS new tokens take the fused path (decode, draft verification
# chains with their forced runs, observations, prefill chunks of `tokenspeed.decode.PREFILL_CHUNK`),
# in calls of at most FUSED_ROWS rows; a call of a prefill burst (>= 16 rows) splits its matmuls and
# attention over torch's threads. Longer forwards (direct model calls) take the Python path.
# `tokenspeed bench prefill` measures the fused path against llama.cpp.
FUSED_ROWS = 64
FUSED_PREFILL_ROWS = 512
_HERE = Path(__file__).parent
SOURCES = (_HERE / "cpu_decode.cpp", _HERE / "cpu_kernels.cpp")  # compiled into the extension
_HEADERS = (_HERE / "cpu_kernels.h", _HERE / "cpu_isa.h")
_FLAGS = ["-O3", "-fno-math-errno", "-fopenmp"]  # OpenMP: at::parallel_for runs on torch's threads
ISA_ENV = "TOKENSPEED_CPU_ISA"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """One instruction-set build of the kernels.

    Attributes:
        name: the `TOKENSPEED_CPU_ISA` value.
        arch: "x86_64" or "aarch64" ("" for any).
        needs: CPU features it needs, as /proc/cpuinfo names them ("flags" on x86, "Features" on ARM).
        cflags: compiler flags selecting its code in `cpu_isa.h`.
    """

    name: str
    arch: str
    needs: tuple[str, ...]
    cflags: tuple[str, ...]


_AVX2 = ("avx2", "fma", "f16c")
# Best first: the default is the first one this CPU runs.
VARIANTS = {v.name: v for v in (
    Variant("avx512", "x86_64", _AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
            ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni")),
    Variant("avx2-vnni", "x86_64", _AVX2 + ("avx_vnni",), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni")),
    Variant("avx2", "x86_64", _AVX2, ("-mavx2", "-mfma", "-mf16c")),
    Variant("neon-dotprod", "aarch64", ("asimd", "asimddp"), ("-march=armv8.2-a+dotprod",)),
    Variant("neon", "aarch64", ("asimd",), ("-march=armv8-a",)),
    Variant("generic", "", (), ("-DTS_ISA_FORCE_GENERIC",)),
)}


@functools.cache
def cpu_features() -> frozenset[str]:
    """This CPU's feature names (/proc/cpuinfo "flags" or "Features"; empty where unreadable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _runs(variant: Variant, arch: str, features: frozenset[str]) -> bool:
    return variant.arch in ("", arch) and set(variant.needs) <= features


class CpuVariantError(ValueError):
    """`$TOKENSPEED_CPU_ISA` (or a variant argument) names an unknown variant or one this CPU cannot run."""


@functools.cache
def native_variant() -> str:
    """The best variant this CPU runs (the default)."""
    arch, features = platform.machine(), cpu_features()
    return next(name for name, v in VARIANTS.items() if _runs(v, arch, features))


def selected_variant() -> str:
    """The variant in force: `$TOKENSPEED_CPU_ISA` if set, else `native_variant()`.

    Raises:
        CpuVariantError: the variable names an unknown variant or one this CPU cannot run.
    """
    name = os.environ.get(ISA_ENV, "").strip()
    if not name:
        return native_variant()
    if name not in VARIANTS:
        raise CpuVariantError(f"{ISA_ENV}={name!r}: unknown variant; choose one of {', '.join(VARIANTS)}")
    v, arch, features = VARIANTS[name], platform.machine(), cpu_features()
    if not _runs(v, arch, features):
        missing = sorted(set(v.needs) - features) or [v.arch]
        raise CpuVariantError(f"{ISA_ENV}={name}: this CPU ({arch}) lacks {', '.join(missing)}; "
                         f"it runs {', '.join(n for n, w in VARIANTS.items() if _runs(w, arch, features))}")
    return name


def load(cache: Path, variant: str | None = None, verbose: bool = False):
    """The compiled extension module for `variant` (builds it on first use), or None if it cannot be built.

    Args:
        cache: the cache root; the build goes to `cache/ext/<variant>-<hash>`.
        variant: a `VARIANTS` name; None: `selected_variant()`.
        verbose: print the compiler's output.
    Returns:
        a module with `decode_layers(...)`, `int4_matmul(x [T, K] fp32, codes, scales) -> [T, N] fp32` (the
        `quant.Int4Linear` layout, or `quant.Q4KInt4Linear`'s: uint8 scales), `int8_gemv(x [T, K] fp32, w [N / 16, Kp / 4, 64] int8, scales [N / 16, G, 16] fp32) -> [T, N] fp32`
        (W8A8 in the `quant.pack_int8` layout, `quant.Int8Linear.reference`), `block_gemv(x [T, K] fp32, blocks [N, K / values * bytes] uint8, ggml_type)
        -> [T, N] fp32` (a GGUF file's Q4_K, Q5_K or Q6_K blocks as stored, `quant.BlockLinear`),
        `q5_0_gemv(x [T, K] fp32, blocks [N / 16, K / 32, 352] uint8) -> [T, N] fp32` (Q5_0 blocks in the
        `quant.pack_q5_0` layout) and `isa() -> str` (the variant's family name).
    Raises:
        CpuVariantError: unknown variant, or one this CPU cannot run.
    """
    name = variant or selected_variant()
    if name not in VARIANTS:
        raise CpuVariantError(f"unknown CPU kernel variant {name!r}; choose one of {', '.join(VARIANTS)}")
    return _load(Path(cache), name, verbose)


@functools.cache
def _load(cache: Path, name: str, verbose: bool):
    v = VARIANTS[name]
    flags = _FLAGS + list(v.cflags)
    key = hashlib.sha256(b"\0".join([*(f.read_bytes() for f in SOURCES + _HEADERS), torch.__version__.encode(),
                                     " ".join(sorted(cpu_features())).encode(), " ".join(flags).encode()]))
    build = cache / "ext" / f"{name}-{key.hexdigest()[:16]}"
    build.mkdir(parents=True, exist_ok=True)
    module_name = "tokenspeed_cpu_decode_" + name.replace("-", "_")
    if shutil.which("ninja") is None:  # the PyPI wheel's binary, when the venv's bin/ is not on PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    built = build / f"{module_name}.so"
    if built.exists():  # import it directly: torch's builder would wait forever on a lock left by a killed build
        spec = importlib.util.spec_from_file_location(module_name, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    lock = build / "lock"  # left behind by a build that was killed (a build takes ~1 min)
    if lock.exists() and time.time() - lock.stat().st_mtime > 600:
        lock.unlink(missing_ok=True)
    from torch.utils.cpp_extension import load as load_ext  # ~50 ms of imports, only to build

    try:
        return load_ext(name=module_name, sources=[str(s) for s in SOURCES], extra_cflags=flags,
                        extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=verbose)
    except Exception as exc:  # compiler missing, build error: the Python path still works
        log.warning("fused CPU decode (%s) unavailable (%s: %s); using the Python decode path (build log: python -c "
                    "'from tokenspeed.quant import fused_ext; fused_ext(verbose=True)')", name, type(exc).__name__,
                    str(exc).splitlines()[0][:200])
        return None


def _projections(layer) -> tuple:
    """A block's projections in the order the C++ step takes them: wqkv, wo, w13, w2."""
    return layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2


def _parts(proj) -> list:
    """The layers of one projection: a `quant.StackedLinear`'s parts, else the projection itself."""
    return list(proj.parts) if hasattr(proj, "parts") else [proj]


_BLOCKS = 16  # the C++ step's kind of GGUF blocks as stored: 16 + the format's ggml type number


def _kind(lin) -> int | None:
    """The C++ step's kind of a projection: 16 + ggml type number for GGUF blocks (`blocks` buffer and a
    `FORMAT`, `quant.BlockLinear`; Q5_0's interleaved by whole blocks of 16 output rows), 2 W4A8 (`codes`, `scales` buffers), 1 int8 (`qweight`, `scales` in the CPU
    layout, whole blocks of 16 output rows), 0 fp32 `nn.Linear`, None for anything else."""
    if hasattr(lin, "blocks"):  # Q5_0's interleaved layout: whole blocks of 16 output rows
        return _BLOCKS + lin.FORMAT.ggml_type if lin.FORMAT.pack is None or lin.out_features % 16 == 0 else None
    if hasattr(lin, "codes") and hasattr(lin, "scales"):
        return 2
    if hasattr(lin, "qweight") and hasattr(lin, "scales"):
        return 1 if lin.qweight.dim() == 3 and lin.out_features % 16 == 0 else None
    return 0 if isinstance(lin, torch.nn.Linear) else None


class FusedDecode:
    """The fused decode step for one `Transformer`: its weights gathered once into flat lists.

    `FusedDecode.supports(model)` says whether the model qualifies (on the CPU, fp32, every block
    projection an `nn.Linear`, `quant.Int8Linear`, `quant.Int4Linear` or a `quant.BlockLinear`, or a
    `quant.StackedLinear` of those); then
    `FusedDecode(ext, model)` with the extension from `load`.
    """

    def __init__(self, ext, model):
        self.ext, self.args = ext, model.args
        empty = torch.empty(0)
        self.tensors, self.kinds, self.parts, self.norms = [], [], [], []
        for layer in model.layers:
            for proj in _projections(layer):
                parts = _parts(proj)
                for lin in parts:
                    bias = lin.bias if lin.bias is not None else empty
                    kind = _kind(lin)
                    weight = (lin.blocks if kind >= _BLOCKS else lin.codes if kind == 2
                              else lin.qweight if kind == 1 else lin.weight)
                    self.tensors += [weight, lin.scales if kind in (1, 2) else empty, bias]
                    self.kinds.append(kind)
                self.parts.append(len(parts))
            self.norms += [layer.attention_norm, layer.ffn_norm]
        # Qwen3's per-head Q/K norms (none elsewhere) and which layers rotate (SmolLM3's NoPE ones do not)
        self.qk_norms = [w for layer in model.layers for w in (layer.attention.q_norm, layer.attention.k_norm)
                         if w is not None]
        self.rotates = [int(layer.attention.rotates) for layer in model.layers]

    @staticmethod
    def supports(model) -> bool:
        """Whether the fused step can run `model` (CPU, fp32, known projection types)."""
        return (model.device.type == "cpu" and model.dtype == torch.float32
                and all(_kind(lin) is not None for layer in model.layers for proj in _projections(layer)
                        for lin in _parts(proj)))

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, start: int) -> torch.Tensor:
        """Run all layers for T new tokens.

        Args:
            h: [T, dim] fp32 token embeddings (overwritten).
            cos, sin: [T, head_dim] fp32 rotary tables at the tokens' positions.
            cache: a `KVCache` of fp16 (the CPU default, `Transformer.kv_dtype`) or fp32 (slots [start,
                start + T) are written; attention reads the keys and values as fp32). If it tracks attention,
                each layer's mass [start + T], log-sum-exp [H, T] and rotated queries [1, H, T, D] are
                handed to `cache.record_attention` after the step, layer by layer, as the Python path does.
        Returns:
            [T, dim] fp32 hidden states after the last layer (before the final norm).
        """
        a = self.args
        h, mass, lse, q = self.ext.decode_layers(
            h, cos, sin, self.tensors, self.kinds, self.parts, self.norms, self.qk_norms, self.rotates, cache.k, cache.v, start,
            a.n_heads, a.n_kv_heads,
            a.head_dim, a.hidden_dim, a.norm_eps, cache.tracks_attention)
        if cache.tracks_attention:
            for layer in range(a.n_layers):
                cache.record_attention(layer, q[layer].unsqueeze(0), mass[layer], lse[layer])
        return h


