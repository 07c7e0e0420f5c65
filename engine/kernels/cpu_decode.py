"""Fused CPU decode step: every decoder layer for a few new tokens in one C++ call.

The Python forward of one token issues ~190 ATen ops per layer (~5,600 per token for the
30-layer SmolLM2-135M), and at ~1.5 us of dispatch each that framework overhead costs as much as
the int4 matmuls themselves (`tokenspeed bench profile`). `cpu_decode.cpp` runs the same math
(RMSNorm, QKV, rotary, KV-cache write, grouped-query attention with the causal mask among the
new tokens, output projection, SwiGLU, residuals) as loops around the same matmul kernels as the
Python path (`int4_matmul`, `int8_gemv`, fp32 GEMM), with the GIL released. It also holds those two
kernels: `int4_matmul`, the W4A8 matmul of every `quant.Int4Linear` (Q4_1 codes x int8-quantized
activations, AVX512-VNNI), and `int8_gemv`, the lm_head projection (int8 weight, fp32 activations, one
pass over the weight).

The extension is compiled once per machine with the C++ compiler torch uses (`make setup` calls
`load()`, ~1 min; ninja comes from PyPI) into `<tokenspeed cache>/ext/<hash>`, the
hash covering the source, torch version and CPU flags. Without a compiler, or if the build fails,
`load()` returns None and the model keeps its Python path (same results, slower), with one
warning.
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
from pathlib import Path

import torch

__all__ = ["load", "FusedDecode", "FUSED_ROWS"]

# Forwards of at most this many new tokens take the fused path (decode, draft verification chains
# with their forced runs, short observations); longer ones (prefill chunks) take the Python path and
# its SDPA attention. Measured at 2K tokens of context, 1 thread: 32 rows 120 vs 140 ms, 64 rows 297
# vs 321 ms (fused vs Python path); at 200 tokens both are equal.
FUSED_ROWS = 64
_SOURCE = Path(__file__).with_name("cpu_decode.cpp")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno"]
log = logging.getLogger(__name__)


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


@functools.cache
def load(verbose: bool = False):
    """The compiled extension module (builds it on first use), or None if it cannot be built.

    Returns:
        a module with `decode_layers(...)`, `int4_matmul(x [T, K] fp32, codes, scales) -> [T, N] fp32` (the
        `quant.Int4Linear` layout) and `int8_gemv(x [T, K] fp32, w [N, K] int8, scales [N] fp32) -> [T, N] fp32`.
    """
    from torch.utils.cpp_extension import load as load_ext

    from ..weights import cache_dir

    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), torch.__version__.encode(), _cpu_flags().encode(),
                                     " ".join(_FLAGS).encode()])).hexdigest()[:16]
    build = cache_dir() / "ext" / key
    build.mkdir(parents=True, exist_ok=True)
    if shutil.which("ninja") is None:  # the PyPI wheel's binary, when the venv's bin/ is not on PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    built = build / "tokenspeed_cpu_decode.so"
    if built.exists():  # import it directly: torch's builder would wait forever on a lock left by a killed build
        spec = importlib.util.spec_from_file_location("tokenspeed_cpu_decode", built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    lock = build / "lock"  # left behind by a build that was killed (a build takes ~1 min)
    if lock.exists() and time.time() - lock.stat().st_mtime > 600:
        lock.unlink(missing_ok=True)
    try:
        return load_ext(name="tokenspeed_cpu_decode", sources=[str(_SOURCE)], extra_cflags=_FLAGS,
                        build_directory=str(build), verbose=verbose)
    except Exception as exc:  # compiler missing, build error: the Python path still works
        log.warning("fused CPU decode unavailable (%s: %s); using the Python decode path (build log: python -c "
                    "'from tokenspeed.kernels.cpu_decode import load; load(verbose=True)')", type(exc).__name__,
                    str(exc).splitlines()[0][:200])
        return None


def _projections(layer) -> tuple:
    """A block's projections in the order the C++ step takes them: wqkv, wo, w13, w2."""
    return layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2


class FusedDecode:
    """The fused decode step for one `Transformer`: its weights gathered once into flat lists.

    Build it with `FusedDecode.build(model)`, which returns None when the model does not qualify
    (not on the CPU, not fp32, a projection of an unknown type) or the extension is unavailable.
    """

    def __init__(self, ext, model):
        from ..quant import Int4Linear, Int8Linear

        self.ext, self.args = ext, model.args
        empty = torch.empty(0)
        self.tensors, self.kinds, self.norms = [], [], []
        for layer in model.layers:
            for lin in _projections(layer):
                bias = lin.bias if lin.bias is not None else empty
                if isinstance(lin, Int4Linear):
                    self.tensors += [lin.codes, lin.scales, bias]
                    self.kinds.append(2)
                elif isinstance(lin, Int8Linear):
                    self.tensors += [lin.qweight, lin.scales, bias]
                    self.kinds.append(1)
                else:
                    self.tensors += [lin.weight, empty, bias]
                    self.kinds.append(0)
            self.norms += [layer.attention_norm, layer.ffn_norm]

    @classmethod
    def build(cls, model) -> "FusedDecode | None":
        """A fused step for `model`, or None if it does not qualify or the extension is unavailable."""
        from ..quant import Int4Linear, Int8Linear

        p = model.tok_embeddings.weight
        if p.device.type != "cpu" or p.dtype != torch.float32:
            return None
        for layer in model.layers:
            for lin in _projections(layer):
                if not isinstance(lin, (Int4Linear, Int8Linear, torch.nn.Linear)):
                    return None
        ext = load()
        return cls(ext, model) if ext is not None else None

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, start: int) -> torch.Tensor:
        """Run all layers for T new tokens.

        Args:
            h: [T, dim] fp32 token embeddings (overwritten).
            cos, sin: [T, head_dim] fp32 rotary tables at the tokens' positions.
            cache: a fp32 `KVCache` (slots [start, start + T) are written). If it tracks attention,
                each layer's mass [start + T], log-sum-exp [H, T] and rotated queries [1, H, T, D] are
                handed to `cache.record_attention` after the step, layer by layer, as the Python path does.
        Returns:
            [T, dim] fp32 hidden states after the last layer (before the final norm).
        """
        a = self.args
        h, mass, lse, q = self.ext.decode_layers(
            h, cos, sin, self.tensors, self.kinds, self.norms, cache.k, cache.v, start, a.n_heads, a.n_kv_heads,
            a.head_dim, a.hidden_dim, a.norm_eps, cache.tracks_attention)
        if cache.tracks_attention:
            for layer in range(a.n_layers):
                cache.record_attention(layer, q[layer].unsqueeze(0), mass[layer], lse[layer])
        return h


