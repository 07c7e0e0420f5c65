"""Engine test fixtures: the real embedded model (loaded once per test run) and a tiny random one."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def engine():
    """The real SmolLM2-135M-Instruct engine (embedded GGUF, converted cache), fp32."""
    import tokenspeed

    torch.manual_seed(0)
    return tokenspeed.Engine.load(quantize=None)


@pytest.fixture(scope="session")
def tiny_engine():
    """A 2-layer random-weight engine with the real tokenizer (shapes only, fast)."""
    import tokenspeed

    return tokenspeed.Engine.load("tiny-random")


@pytest.fixture(scope="session")
def robot_tools():
    """The robot-arm tool set from tokenspeed_ros/config/robot_tools.json."""
    return json.loads((ROOT / "tokenspeed_ros" / "config" / "robot_tools.json").read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def base_url():
    """URL of a real `tokenspeed serve` process on 127.0.0.1 (embedded model, int4, queue of one
    waiting request, 2048-token conversations), stopped at the end of the test run."""
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenspeed.cli", "serve", "--port", str(port), "--queue-size", "1",
                             "--quantize", "int4", "--context", "2048", "--cache-budget-mb", "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                pytest.fail(f"server exited: {proc.stdout.read()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("server did not come up in 300 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
