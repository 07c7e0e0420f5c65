"""Helpers shared by the tests: repository paths, stopping a child process, spinning an rclpy
executor until a condition holds, one decision per prompt, README examples. (tests/ is on sys.path through
tests/conftest.py.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent          # the venv's console entry points


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGINT the process group, SIGKILL it after `timeout` seconds; returns the exit status.
    Start the process with `start_new_session=True` (its own group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def spin_until(executor, predicate, timeout: float) -> bool:
    """Spin the rclpy `executor` until `predicate()` is true (returns True) or `timeout` seconds
    pass (returns predicate())."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        executor.spin_once(timeout_sec=0.02)
    return bool(predicate())


def decide_each(engine, tools: list[dict], prompts: list[str], system: str = "You control a robot arm.",
                **session_args) -> list:
    """One `decide()` per prompt, each in a fresh session with `tools` (and `session_args`, e.g.
    kv_budget); asserts every status is "ok" and returns the Decisions."""
    decisions = []
    for prompt in prompts:
        session = engine.session(system=system, tools=tools, **session_args)
        session.observe(prompt)
        decisions.append(session.decide())
        assert decisions[-1].status == "ok", decisions[-1].reason
    return decisions


def readme_example(name: str) -> str:
    """The Python code of the README block between `<!-- example: NAME -->` and `<!-- /example -->`."""
    text = (ROOT / "README.md").read_text()
    block = text.split(f"<!-- example: {name} -->", 1)[1].split("<!-- /example -->", 1)[0]
    return block.split("```python\n", 1)[1].rsplit("```", 1)[0]


@contextmanager
def serve_process(*args: str):
    """`tokenspeed serve ARGS` on a free port of 127.0.0.1 in a child process: yields (process, base
    URL) once it answers, terminates it afterwards (`tokenspeed.bench.peers.server_process`: a
    RuntimeError when the server exits first or takes over 300 s)."""
    from tokenspeed.bench.peers import server_process

    with server_process([sys.executable, "-m", "tokenspeed.cli", "serve", *args],
                        env=dict(os.environ, PYTHONUNBUFFERED="1"), startup_s=300, name="tokenspeed serve") as running:
        yield running
