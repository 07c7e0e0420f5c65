"""One executor step that survives a sample rclpy cannot take (a peer dying mid-write)."""
from __future__ import annotations

import traceback

from rclpy.executors import Executor

SPIN_TIMEOUT_S = 0.05   # seconds one executor step waits for work


def is_take_failure(error: BaseException) -> bool:
    """True when `error` was raised by rclpy taking (deserializing) a subscription's sample, not
    by a callback: e.g. pybind11's "Unable to convert call argument '0' to Python object" for a
    sample a publisher process left half-written as it was killed."""
    return isinstance(error, RuntimeError) and any(
        frame.name == "_take_subscription" for frame in traceback.extract_tb(error.__traceback__))


def spin_once(executor: Executor, timeout_sec: float, logger) -> None:
    """`executor.spin_once(timeout_sec)` (seconds); a sample that fails to take is dropped with a
    throttled warning on `logger` (an rclpy logger) and the node keeps running. Errors raised by
    callbacks, KeyboardInterrupt and ExternalShutdownException propagate unchanged."""
    try:
        executor.spin_once(timeout_sec=timeout_sec)
    except RuntimeError as e:
        if not is_take_failure(e):
            raise
        logger.warning(f"dropped a sample rclpy could not take: {e}", throttle_duration_sec=10.0)
