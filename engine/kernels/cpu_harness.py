"""The torch-free CPU kernels of one instruction-set variant, built and run outside torch.

`build` compiles `cpu_kernels.cpp` with `kernel_harness.cpp` (a request/reply program on
stdin/stdout) for a `cpu_decode.VARIANTS` entry, natively or with a cross compiler (aarch64:
Debian's `g++-aarch64-linux-gnu`, run under `qemu-aarch64`); `Harness` sends it tensors and reads
the results back. The tests check every variant this machine can run, and the ARM ones under
qemu-user, against the same references as the extension; a build takes seconds (no torch headers).
"""
from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import torch

from .cpu_decode import VARIANTS

__all__ = ["build", "Harness"]

_HERE = Path(__file__).parent


def build(variant: str, out: Path, compiler: str = "g++", static: bool = False) -> Path:
    """Compile the harness for `variant` into the file `out`; returns `out`.

    Raises:
        KeyError: unknown variant.
        subprocess.CalledProcessError: the compiler failed (its output is in the exception).
    """
    cmd = [compiler, "-std=c++17", "-O3", "-fno-math-errno", *VARIANTS[variant].cflags, *(["-static"] if static else []),
           str(_HERE / "cpu_kernels.cpp"), str(_HERE / "kernel_harness.cpp"), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def _i64(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


class Harness:
    """A built harness program; `runner` prefixes its command (e.g. ["qemu-aarch64", "-cpu", "max"])."""

    def __init__(self, exe: Path, runner: tuple[str, ...] = ()):
        self.cmd = [*runner, str(exe)]

    def _call(self, request: bytes, n: int, dtype=np.float32) -> np.ndarray:
        out = subprocess.run(self.cmd, input=request, capture_output=True, check=True, timeout=120).stdout
        return np.frombuffer(out, dtype=dtype, count=n)

    def isa(self) -> str:
        """The family name the build reports (as the extension's `isa()`)."""
        out = subprocess.run(self.cmd, input=struct.pack("<i", 0), capture_output=True, check=True, timeout=60).stdout
        return out[4:4 + struct.unpack("<i", out[:4])[0]].decode()

    def int4_matmul(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x [T, K] fp32, codes [N/16, K/8, 64] uint8, scales [N/16, K/32, 2, 16] bf16 (`quant.Int4Linear`) or
        [N/16, K/256, 320] uint8 (`quant.Q4KInt4Linear`) -> y [T, N] fp32."""
        T, K = x.shape
        N = codes.shape[0] * 16
        op, raw = (9, scales) if scales.dtype == torch.uint8 else (1, scales.view(torch.int16))
        req = struct.pack("<i", op) + _i64(T, K, N) + _raw(x.float()) + _raw(codes) + _raw(raw)
        return torch.from_numpy(self._call(req, T * N).copy()).view(T, N)

    def int8_gemv(self, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x [T, K] fp32, w [N / 16, Kp / 4, 64] int8, scales [N / 16, G, 16] fp32 (`quant.pack_int8`'s layout) ->
        y [T, N] fp32 (W8A8, as the extension's)."""
        T, K = x.shape
        N, Kp, G = w.shape[0] * 16, w.shape[1] * 4, scales.shape[1]
        req = struct.pack("<i", 2) + _i64(T, K, Kp, N, G) + _raw(x.float()) + _raw(w) + _raw(scales.float())
        return torch.from_numpy(self._call(req, T * N).copy()).view(T, N)

    def block_gemv(self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
        """x [T, K] fp32, a GGUF block format's blocks [N, K / values * bytes] uint8 (`ggml_type`: Q4_K, Q5_K
        or Q6_K's number) -> y [T, N] fp32 (as the extension's `block_gemv`)."""
        T, K = x.shape
        N = blocks.shape[0]
        req = struct.pack("<i", 6) + _i64(ggml_type, T, K, N) + _raw(x.float()) + _raw(blocks)
        return torch.from_numpy(self._call(req, T * N).copy()).view(T, N)

    def q5_0_gemv(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """x [T, K] fp32, Q5_0 blocks interleaved by 16 rows [N / 16, K / 32, 352] uint8 (`quant.pack_q5_0`) ->
        y [T, N] fp32 (as the extension's `q5_0_gemv`)."""
        T, K = x.shape
        N = blocks.shape[0] * 16
        req = struct.pack("<i", 8) + _i64(T, K, N) + _raw(x.float()) + _raw(blocks)
        return torch.from_numpy(self._call(req, T * N).copy()).view(T, N)

    def attend(self, q: torch.Tensor, T: int, start: int, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [R, D] (row r = head-in-group * T + token), k and v [start + T, D] fp32, or fp16 (the
        half-float kernel, `ts_attend_rows_half`) -> (probabilities [R, start + T], out [R, D],
        log-sum-exp [R]); row r sees slots [0, start + r % T]."""
        R, D = q.shape
        end = start + T
        kv = torch.float16 if k.dtype == torch.float16 else torch.float32
        req = (struct.pack("<i", 4 if kv == torch.float16 else 3) + _i64(R, T, start, D) + struct.pack("<f", scale)
               + _raw(q.float()) + _raw(k[:end].to(kv)) + _raw(v[:end].to(kv)))
        flat = torch.from_numpy(self._call(req, R * end + R * D + R).copy())
        return flat[:R * end].view(R, end), flat[R * end:R * end + R * D].view(R, D), flat[R * end + R * D:]

    def swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2F] fp32 (gate, then up) -> silu(gate) * up [T, F] fp32 (`ts_swiglu`, the fused step's MLP activation)."""
        T, F = gu.shape[0], gu.shape[1] // 2
        return torch.from_numpy(self._call(struct.pack("<i", 7) + _i64(T, F) + _raw(gu.float()), T * F).copy()).view(T, F)

    def to_half(self, x: torch.Tensor) -> torch.Tensor:
        """x [n] fp32 rounded to IEEE half floats by the kernels' KV write (`ts_to_half`) -> [n] fp16."""
        n = x.numel()
        return torch.from_numpy(self._call(struct.pack("<i", 5) + _i64(n) + _raw(x.float()), n, np.float16).copy())
