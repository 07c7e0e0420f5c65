"""Start-up stages of an engine process, without torch: `LoadStages` (what `Engine.load` fills and
the ROS nodes begin at process start, before they import the engine) and `process_age_s`."""
from __future__ import annotations

import os
import time

__all__ = ["LoadStages", "process_age_s", "memory_mib"]


def process_age_s() -> float:
    """Wall seconds since this process started (its exec). Linux: from /proc/self/stat and the
    boot-time clock, to a clock tick (10 ms); elsewhere from psutil's create time (whole seconds of
    boot time on some systems)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        import psutil

        return time.time() - psutil.Process().create_time()


def memory_mib() -> tuple[float, float] | None:
    """(resident set size now, its peak since the process started) of this process in MiB: Linux's
    VmRSS and VmHWM (/proc/self/status, ~20 us), or None where they cannot be read."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


class LoadStages(dict):
    """Start-up stages, in order: name -> (wall s, CPU s of the whole process) since the previous
    stage (or since construction). `Engine.load` fills one (`Engine.load_stages`); callers may
    begin it before (the ROS nodes: from process start) and continue it with their own stages.

    Attributes:
        memory: name -> (RSS MiB at the stage's end, the process's peak RSS MiB until then:
            `memory_mib`) of the stages closed with `done` where the system states them. A stage
            whose peak exceeds the previous stage's set a new peak of the process.
        start_memory: `memory_mib()` at construction (the process before the first stage), or None.
    """

    def __init__(self):
        super().__init__()
        self.memory: dict[str, tuple[float, float]] = {}
        self.start_memory = memory_mib()
        self._clock = (time.perf_counter(), time.process_time())

    def add(self, name: str, wall_s: float, cpu_s: float) -> None:
        """Record a stage measured elsewhere (e.g. before the engine was imported)."""
        self[name] = (wall_s, cpu_s)

    def done(self, name: str) -> None:
        """Close the stage `name` now."""
        now = (time.perf_counter(), time.process_time())
        self[name] = (now[0] - self._clock[0], now[1] - self._clock[1])
        memory = memory_mib()
        if memory is not None:
            self.memory[name] = memory
        self._clock = now

    def table(self) -> str:
        """The stages as a text table (wall and CPU seconds, RSS and peak RSS MiB at each stage's
        end where known, total last)."""
        width = max(map(len, self), default=5)

        def mib(name: str) -> str:
            rss, peak = self.memory.get(name, (None, None))
            return f" {rss:8.0f} {peak:8.0f}" if rss is not None else ""

        head = f"  {'stage':<{width}} {'wall':>9} {'CPU':>9}" + (f" {'RSS MiB':>8} {'peak':>8}" if self.memory else "")
        rows = [f"  {name:<{width}} {w:7.2f} s {c:7.2f} s{mib(name)}" for name, (w, c) in self.items()]
        total = [sum(v[i] for v in self.values()) for i in (0, 1)]
        return "\n".join([head, *rows, f"  {'total':<{width}} {total[0]:7.2f} s {total[1]:7.2f} s"])
