"""tokenspeed_ros.spin: a sample that fails to take is dropped, a callback's error is not."""

import pytest
import rclpy
from rclpy.executors import SingleThreadedExecutor

from tokenspeed_ros.spin import spin_once


class Recorder:
    """Collects the warnings spin_once logs (rclpy logger interface: warning(msg, **kw))."""

    def __init__(self):
        self.warnings = []

    def warning(self, msg, **_):
        self.warnings.append(msg)


@pytest.fixture
def context():
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    yield ctx
    ctx.try_shutdown()


def test_an_error_in_a_callback_propagates(context):
    node = rclpy.create_node("spin_callback_error", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)

    def fail():
        raise RuntimeError("bug in a callback")

    node.create_timer(0.001, fail)
    try:
        with pytest.raises(RuntimeError, match="bug in a callback"):
            for _ in range(100):
                spin_once(executor, 0.05, Recorder())
    finally:
        executor.shutdown()
        node.destroy_node()


def test_a_sample_that_fails_to_take_is_dropped_with_a_warning():
    """A FAKE executor: a half-written sample from a publisher killed mid-write (the fault seen in
    CI at a launch's Ctrl-C) cannot be caused on demand, so the executor raises the error rclpy's
    take raised there, from a frame of the same name."""

    class TakeFails:
        def spin_once(self, timeout_sec):
            def _take_subscription():
                raise RuntimeError("Unable to convert call argument '0' to Python object")
            _take_subscription()

    log = Recorder()
    spin_once(TakeFails(), 0.05, log)
    assert len(log.warnings) == 1 and "could not take" in log.warnings[0]
