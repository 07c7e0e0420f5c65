"""Fixtures for the simulator tests: the real sim node in its own process, and an rclpy peer."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIM_PARAMS = ROOT / "launch" / "config" / "cobot_sim.yaml"


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGINT, then SIGKILL after `timeout` seconds; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture
def sim_process(ros_env):
    """`tokenspeed_cobot_sim` with launch/config/cobot_sim.yaml in a child process (same ROS domain)."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenspeed_sim.sim_node", "--ros-args",
                             "--params-file", str(SIM_PARAMS)], env=ros_env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc
    stop_process(proc)


@pytest.fixture
def ros_node(ros_env):
    """An rclpy node in this process, in the test's ROS domain; spin it with `spin_until`."""
    import rclpy
    rclpy.init()
    node = rclpy.create_node("sim_test_peer")
    yield node
    node.destroy_node()
    rclpy.try_shutdown()


@pytest.fixture
def spin(ros_node):
    """spin(condition, timeout=20.0): spin the peer node until condition() is true or `timeout`
    seconds pass; returns condition()."""
    import rclpy

    def spin_until(condition, timeout: float = 20.0) -> bool:
        end = time.monotonic() + timeout
        while not condition() and time.monotonic() < end:
            rclpy.spin_once(ros_node, timeout_sec=0.05)
        return bool(condition())
    return spin_until
