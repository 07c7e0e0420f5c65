"""Fixtures for the ROS tests: the real agent node in child processes (`start_agent`) and an
rclpy probe node in the test process (`probe`), both in the test's ROS domain (`ros_env`)."""
import subprocess

import pytest

from agent_support import AGENT_PARAMS, Probe
from support import BIN, ROOT, stop


@pytest.fixture
def start_agent(ros_env, tmp_path):
    """Factory: start `tokenspeed_agent` with tokenspeed_ros/config/agent.yaml plus `-p name:=value`
    overrides; returns the Popen (output in `proc.log_path`). Stopped with SIGINT at teardown."""
    procs = []

    def start(**params) -> subprocess.Popen:
        log = tmp_path / f"agent{len(procs)}.log"
        cmd = [str(BIN / "tokenspeed_agent"), "--ros-args", "--params-file", str(AGENT_PARAMS)]
        for k, v in params.items():
            cmd += ["-p", f"{k}:={v}"]
        proc = subprocess.Popen(cmd, env=ros_env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        proc.log_path = log
        procs.append(proc)
        return proc

    yield start
    for p in procs:
        stop(p)


@pytest.fixture
def probe(ros_env):
    p = Probe()
    yield p
    p.close()


