"""Gaps between device kernels in a profile: how long the GPU sat idle while the host prepared work.

`kernel_gaps` is arithmetic over (name, start, duration) intervals; `device_kernels` takes them
from the events of a finished `torch.profiler.profile` (activities on a CUDA device: kernels,
copies and memsets; not the GPU ranges of `record_function` annotations).
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

from .report import percentile

__all__ = ["Kernel", "NO_KERNELS", "kernel_gaps", "device_kernels"]

NO_KERNELS = "no device kernels"


class Kernel(NamedTuple):
    """One device activity of a profile: its name, start and duration in microseconds (trace clock)."""

    name: str
    start_us: float
    duration_us: float


def kernel_gaps(kernels: Iterable[Kernel], largest: int = 5) -> dict:
    """Busy and idle time of the device over `kernels`, and the gaps between them.

    Kernels are taken in start order; the gap before a kernel is the time from the latest end of
    the kernels before it to its start (0 when it starts before that end: kernels overlapping on
    several streams count once in the busy time). idle_us = span_us - busy_us = the sum of the gaps.

    Args:
        kernels: device activities, any order.
        largest: how many of the largest gaps to list.
    Returns:
        {"kernels": count, "busy_us", "span_us" (first start -> last end), "idle_us",
        "idle_fraction" (idle / span, 0..1), "gap_p50_us", "gap_p90_us", "gap_max_us" (nearest-rank
        over the count - 1 gaps; None for one kernel), "largest": [{"gap_us", "at_us" (where the gap
        starts), "before" (the kernel whose end opened it), "after" (the kernel that closed it)}],
        largest first}. With no kernels: "kernels" 0, every figure None, "largest" [] and "note":
        `NO_KERNELS` (a CPU run, or a profiler without CUDA activity).
    Raises:
        ValueError: a negative duration.
    """
    ks = sorted(kernels, key=lambda k: (k.start_us, k.duration_us))
    bad = [k for k in ks if k.duration_us < 0]
    if bad:
        raise ValueError(f"kernel {bad[0].name!r} has a negative duration ({bad[0].duration_us} us)")
    if not ks:
        return {"kernels": 0, "busy_us": None, "span_us": None, "idle_us": None, "idle_fraction": None,
                "gap_p50_us": None, "gap_p90_us": None, "gap_max_us": None, "largest": [], "note": NO_KERNELS}
    end, last = ks[0].start_us + ks[0].duration_us, ks[0].name  # the latest end so far, and whose
    busy, gaps = ks[0].duration_us, []
    for k in ks[1:]:
        k_end = k.start_us + k.duration_us
        gaps.append({"gap_us": max(0.0, k.start_us - end), "at_us": end, "before": last, "after": k.name})
        busy += max(0.0, k_end - max(k.start_us, end))
        if k_end > end:
            end, last = k_end, k.name
    span = end - ks[0].start_us
    values = [g["gap_us"] for g in gaps]
    return {"kernels": len(ks), "busy_us": busy, "span_us": span, "idle_us": span - busy,
            "idle_fraction": (span - busy) / span if span > 0 else 0.0,
            "gap_p50_us": percentile(values, 50), "gap_p90_us": percentile(values, 90),
            "gap_max_us": max(values, default=None),
            "largest": sorted(gaps, key=lambda g: -g["gap_us"])[:largest]}


def device_kernels(events) -> list[Kernel]:
    """The CUDA device activities of a finished profile's events (`prof.events()`), as `Kernel`s
    on the profile's clock (the host events share it). Empty for a CPU-only profile."""
    from torch.autograd import DeviceType

    return [Kernel(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in events
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
