"""Fixtures for the simulator tests: the real sim node in its own process, and an rclpy peer."""
import subprocess
import sys

import pytest

from support import ROOT, spin_until, stop

SIM_PARAMS = ROOT / "tokenspeed_ros" / "config" / "cobot_sim.yaml"


@pytest.fixture
def sim_process(ros_env):
    """`tokenspeed_cobot_sim` with tokenspeed_ros/config/cobot_sim.yaml in a child process (same ROS
    domain, own process group: stop it with support.stop)."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenspeed_sim.sim_node", "--ros-args",
                             "--params-file", str(SIM_PARAMS)], env=ros_env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    yield proc
    stop(proc)


@pytest.fixture
def ros_node(ros_env):
    """An rclpy node in this process, in the test's ROS domain; spin it with `spin`."""
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
    from rclpy.executors import SingleThreadedExecutor

    executor = SingleThreadedExecutor()
    executor.add_node(ros_node)
    yield lambda condition, timeout=20.0: spin_until(executor, condition, timeout)
    executor.shutdown()
