"""Engine test fixtures: the real embedded model (loaded once per test run) and a tiny random one."""
import json
import os
from pathlib import Path

import pytest
import torch
from support import serve_process

ROOT = Path(__file__).resolve().parents[2]
# Triton reads this when a kernel module is first imported (any test may import one first): on a
# machine without CUDA the kernels run under the interpreter, on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
    """The robot-arm tool set from engine/data/tools/robot_tools.json."""
    return json.loads((ROOT / "engine" / "data" / "tools" / "robot_tools.json").read_text())


@pytest.fixture(scope="session")
def base_url():
    """URL of a real `tokenspeed serve` process on 127.0.0.1 (embedded model, int4, queue of one
    waiting request, 2048-token conversations), stopped at the end of the test run."""
    with serve_process("--queue-size", "1", "--quantize", "int4", "--context", "2048",
                       "--cache-budget-mb", "200") as (_, url):
        yield url
