"""Where the engine's tensors live: the device and dtype settings, host-to-device copies, and the
decode step as a CUDA graph (`DecodeGraphs`).

Everything here runs on the CPU too: the graph runner then runs its step eagerly through the
same buffers, so the CPU tests check its bookkeeping.
"""
from __future__ import annotations

import torch

__all__ = ["DeviceError", "DTYPES", "resolve_device", "resolve_dtype", "to_device"]


class DeviceError(ValueError):
    """A device or dtype setting is malformed, or names a device this machine does not have
    (e.g. "cuda" without a CUDA GPU)."""


# dtype names the CLI and the ROS nodes accept ("auto": bf16 on CUDA, fp32 elsewhere)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: "str | torch.device | None" = "auto") -> torch.device:
    """The torch device for a device setting: "auto" (or None) -> "cuda" when
    `torch.cuda.is_available()`, else "cpu"; "cpu"; "cuda" or "cuda:N".

    Raises:
        DeviceError: not one of those, or CUDA (device N) is not available here.
    """
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {device!r} asked for, but CUDA is not available here "
                          f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use --device cpu or auto")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def resolve_dtype(dtype: "str | torch.dtype | None", device: torch.device) -> torch.dtype:
    """The weight and KV-cache dtype for a dtype setting on `device`: "auto" (or None) -> bfloat16
    on CUDA, float32 elsewhere; a `DTYPES` name or a torch floating dtype as given.

    Raises:
        DeviceError: an unknown name or a non-floating dtype.
    """
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise DeviceError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """[N] int64 tensor of `values` on `device` (on CUDA through pinned memory, copied non-blocking)."""
    t = torch.tensor(values, dtype=torch.long, device="cpu")
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
