"""The `tokenspeed` command line: help lists every subcommand, `call` checks the tools before the
model loads, `serve` on a port in use is one error line (exit 1) before the model loads; bad input (tools, `--device
cuda` without CUDA, option values) is one error line with exit 2, as argparse's usage errors."""
import json
import socket
import subprocess
import sys

import pytest
import torch

from tokenspeed import DeviceError
from tokenspeed.cli import build_parser
from tokenspeed.device import resolve_device, resolve_dtype


def test_help_lists_every_bench_subcommand():
    text = build_parser().format_help()
    assert "bench kv" in text and "bench aal" in text


def test_call_refuses_bad_tools_before_loading_the_model(tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "bad name!", "parameters": {}}}]))
    # A model path that does not exist: had the model been loaded first, the error would be about it.
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "call", "--tools", str(tools), "--prompt", "hi",
                        "--model", str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "bad name!" in r.stderr and "missing.gguf" not in r.stderr, r.stderr
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "hold", "parameters": {}}}]))
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "call", "--tools", str(tools), "--prompt", "hi",
                        "--tool", "grasp", "--model", str(tmp_path / "missing.gguf")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "'grasp' is not in" in r.stderr and "missing.gguf" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: --tool 'grasp'") and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "call", "--tools", str(tmp_path / "none.json"),
                        "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: tools file") and "Traceback" not in r.stderr, r.stderr


def test_serve_refuses_bad_option_values_with_exit_2():
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "serve", "--model", "tiny-random", "--context", "8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith("error: --queue-size must be"), r.stderr


def test_serve_on_a_port_in_use_is_one_clear_error_line():
    with socket.socket() as taken:  # a real listener holds the port: serve cannot bind it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "serve", "--model", "tiny-random",
                            "--port", str(port)], capture_output=True, text=True, timeout=120)
    # exit 1, no traceback, no "serving on", and the port is refused before the model loads
    assert r.returncode == 1 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use", r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error_exit_2(tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "hold", "parameters": {}}}]))
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "call", "--tools", str(tools), "--prompt", "hi",
                        "--model", "tiny-random", "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("error: device 'cuda' asked for, but CUDA is not available here"), r.stderr
    assert "Traceback" not in r.stderr


def test_device_and_dtype_settings_resolve():
    cpu = torch.device("cpu")
    assert resolve_device("cpu") == cpu and resolve_dtype("auto", cpu) == torch.float32
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16  # the CUDA default
    assert resolve_dtype("bf16", cpu) == resolve_dtype(torch.bfloat16, cpu) == torch.bfloat16
    for bad in ("tpu", "cuda:x", "gpu"):
        with pytest.raises(DeviceError, match="device must be auto, cpu, cuda or cuda:N"):
            resolve_device(bad)
    with pytest.raises(DeviceError, match="dtype must be auto or one of"):
        resolve_dtype("int4", cpu)
    args = build_parser().parse_args(["serve", "--device", "cpu", "--dtype", "bfloat16"])
    assert (args.device, args.dtype) == ("cpu", "bfloat16")
