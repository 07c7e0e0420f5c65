"""`tokenspeed_demo` end to end: simulator + agent (tiny random-weight model) as separate
processes over DDS, the harness's table/JSON/PNG, clean exit, no process left behind."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT


def processes_in_domain(domain: str) -> list[str]:
    """Command lines of live processes (other than this one) started with ROS_DOMAIN_ID=domain."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"ROS_DOMAIN_ID={domain}".encode() in env:
            found.append(cmdline)
    return found


@pytest.mark.slow
def test_demo_runs_the_closed_loop_and_leaves_no_process(ros_env, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tokenspeed_sim.demo", "--duration", "8", "--ready-timeout", "150",
                          "--out", str(tmp_path), "--set", "tokenspeed_agent.model=tiny-random"],
                         env=ros_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "closed-loop latency" in out.stdout and "task: Put the red cube" in out.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["engine_ready_after_s"] is not None and report["decisions"] >= 1
    assert report["feedback"].get("applied", 0) >= report["decisions"] - 1     # the last may be in flight
    assert report["task"]["target_object"] == "red_cube"
    assert report["run_task"]["accepted"] and report["run_task"]["feedback"] >= 1     # the task came as an action
    assert (tmp_path / "latency.png").stat().st_size > 10_000
    log = (tmp_path / "launch.log").read_text()
    assert "tokenspeed_cobot_sim exit status 0" in log and "tokenspeed_agent exit status 0" in log
    assert "/tokenspeed_agent: activated" in log and "task: Put the red cube" in log
    assert processes_in_domain(ros_env["ROS_DOMAIN_ID"]) == []


def test_a_refused_parameter_ends_the_demo_with_the_reason(ros_env, tmp_path):
    """An integer for a float parameter: the agent refuses it and exits 2; the demo ends with its
    status and prints the agent's refusal (not the simulator's output as it was stopped), and no
    node prints a traceback."""
    out = subprocess.run([sys.executable, "-m", "tokenspeed_sim.demo", "--duration", "20", "--out", str(tmp_path),
                          "--set", "tokenspeed_agent.deadline_budget_s=1"],
                         env=ros_env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "stopping: tokenspeed_agent exited with status 2" in out.stdout
    assert "deadline_budget_s refused" in out.stdout and "decimal point: 1.0" in out.stdout
    assert "Traceback" not in (tmp_path / "launch.log").read_text()
    assert processes_in_domain(ros_env["ROS_DOMAIN_ID"]) == []
