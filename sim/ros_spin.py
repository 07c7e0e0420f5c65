"""Spinning the simulator's rclpy nodes until SIGINT/SIGTERM, without rclpy's own signal handlers.

rclpy's handlers shut the context down from inside the signal, which races with an executor that
is building its wait set (`RCLError: the given context is not valid`) and turns a clean Ctrl-C
into a traceback. Here a signal only sets an event; the loop sees it between spins, and the
caller shuts rclpy down afterwards.
"""
from __future__ import annotations

import signal
import threading
import time

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions

from tokenspeed_ros.spin import SPIN_TIMEOUT_S, spin_once


def init(args: list[str] | None = None) -> None:
    """rclpy.init without rclpy's SIGINT/SIGTERM handlers (use `Spinner.spin` to stop on signals)."""
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)


class Spinner:
    """Spins one rclpy node in this thread, call after call, on one executor: the done callbacks
    of a future that resolves in one `spin` call (an action goal accepted, its result, a service
    answer: rclpy schedules them as executor tasks) run in the next call. An executor per call
    would be shut down with such a task still queued, and the callback lost. Use as a context
    manager, or call `close()`; the node itself is the caller's to destroy."""

    def __init__(self, node) -> None:
        self.node = node
        self._executor = SingleThreadedExecutor()
        self._executor.add_node(node)

    def spin(self, duration_s: float | None = None, until=None) -> str:
        """Spin until SIGINT/SIGTERM, `duration_s` seconds, or `until()` is true; returns why it
        stopped ("SIGINT", "SIGTERM", "duration", "until"). Signal handlers are restored afterwards."""
        why: list[str] = []
        stop = threading.Event()

        def on_signal(signum, _frame):
            why.append(signal.Signals(signum).name)
            stop.set()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        end = None if duration_s is None else time.monotonic() + duration_s
        try:
            while not stop.is_set():
                if end is not None and time.monotonic() >= end:
                    return "duration"
                if until is not None and until():
                    return "until"
                spin_once(self._executor, SPIN_TIMEOUT_S, self.node.get_logger())
            return why[0]
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def close(self) -> None:
        """Remove the node from the executor and shut the executor down."""
        self._executor.remove_node(self.node)
        self._executor.shutdown()

    def __enter__(self) -> "Spinner":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
