"""Fixtures for the ROS tests: the real agent node in child processes (`start_agent`) and an
rclpy probe node in the test process (`probe`), both in the test's ROS domain (`ros_env`)."""
import subprocess
import sys

import pytest

from agent_support import AGENT_PARAMS, Probe
from support import BIN, ROOT, stop


@pytest.fixture
def start_agent(ros_env, tmp_path):
    """Factory: start `tokenspeed_agent` with tokenspeed_ros/config/agent.yaml plus `-p name:=value`
    overrides and `remaps` ({from: to}, `-r from:=to`); returns the Popen (output in
    `proc.log_path`). `code`: Python source run instead of the console entry point (with the same
    arguments), for a test that injects a fault it cannot cause from outside. Stopped with SIGINT
    at teardown."""
    procs = []

    def start(remaps: dict[str, str] | None = None, code: str | None = None, **params) -> subprocess.Popen:
        log = tmp_path / f"agent{len(procs)}.log"
        cmd = [sys.executable, "-c", code] if code else [str(BIN / "tokenspeed_agent")]
        cmd += ["--ros-args", "--params-file", str(AGENT_PARAMS)]
        for k, v in params.items():
            cmd += ["-p", f"{k}:={v}"]
        for k, v in (remaps or {}).items():
            cmd += ["-r", f"{k}:={v}"]
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


