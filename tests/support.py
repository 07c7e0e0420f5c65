"""Helpers shared by the tests: repository paths, stopping a child process, spinning an rclpy
executor until a condition holds, one decision per prompt, README examples, random GGUF blocks (Q4_K,
Q5_K, Q6_K, Q5_0). (tests/ is on sys.path through tests/conftest.py.)"""
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


def q6k_blocks(n: int, k: int, seed: int = 0, d: float = 1e-4, scale: int = 127):
    """Random Q6_K blocks [n, k / 256 * 210] uint8 (ggml's block_q6_K): every code 0..63 and int8
    scale in -scale..scale, fp16 d uniform in [0, d) per block (weights ~ d * scale * 18 in size)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    b[..., 192:208] = rng.integers(-scale, scale + 1, (n, k // 256, 16)).astype(np.int8).view(np.uint8)
    b[..., 208:] = (rng.random((n, k // 256, 1)) * d).astype(np.float16).view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


def qk_blocks(n: int, k: int, fifth_bit: bool = False, seed: int = 0, d: float = 1e-3):
    """Random Q4_K (or, with `fifth_bit`, Q5_K) blocks [n, k / 256 * (144 or 176)] uint8 (ggml's block_q4_K /
    block_q5_K): every code, fifth bit and 6-bit scale and minimum random, fp16 d and dmin uniform in
    [0, d) per block."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // 256, 176 if fifth_bit else 144), dtype=np.uint8)
    b[..., :4] = (rng.random((n, k // 256, 2)) * d).astype(np.float16).view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


def block_layer(fmt: str, n: int, k: int, seed: int = 0):
    """A `quant.BlockLinear` of format `fmt` ("Q4_K", "Q5_K", "Q6_K" or "Q5_0") over random blocks [n, k]."""
    from tokenspeed import quant

    blocks = {"Q4_K": lambda: qk_blocks(n, k, seed=seed), "Q5_K": lambda: qk_blocks(n, k, True, seed=seed),
              "Q6_K": lambda: q6k_blocks(n, k, seed=seed), "Q5_0": lambda: q5_0_blocks(n, k, seed=seed)}[fmt]()
    return quant.BLOCK_LINEARS[fmt](blocks)


def q5_0_blocks(n: int, k: int, seed: int = 0, d: float = 1e-2):
    """Random Q5_0 blocks [n, k / 32 * 22] uint8 (ggml's block_q5_0): every code 0..31 (random qh and qs
    bytes), fp16 d uniform in [0, d) per block."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // 32, 22), dtype=np.uint8)
    b[..., :2] = (rng.random((n, k // 32, 1)) * d).astype(np.float16).view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))
