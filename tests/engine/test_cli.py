"""The `tokenspeed` command line: help lists every subcommand, `call` checks the tools before the
model loads, `serve` on a port in use is one error line (exit 1) before the model loads, SIGINT/SIGTERM end `serve`
with one line and exit 0 (Ctrl-C while torch imports or the model loads: one line and exit 130); bad input (tools, `--device cuda` without CUDA, option values) is one error line with
exit 2, as argparse's usage errors."""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tokenspeed import DeviceError
from tokenspeed.cli import build_parser
from tokenspeed.device import resolve_device, resolve_dtype

ROBOT_TOOLS = Path(__file__).resolve().parents[2] / "engine" / "data" / "tools" / "robot_tools.json"


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
    tools.write_text("[]")  # no tools: refused before the model loads, in the CLI's terms
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "call", "--tools", str(tools), "--prompt", "hi",
                        "--model", str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"error: --tools {tools} holds no tools"), r.stderr


@pytest.mark.parametrize("command", ["call", "generate"])
@pytest.mark.parametrize("value", ["-1", "0", "ten"])
def test_a_bad_max_tokens_is_refused_before_the_model_loads(tmp_path, command, value):
    extra = ["--tools", str(tmp_path / "none.json")] if command == "call" else []
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", command, *extra, "--prompt", "hi",
                        "--max-tokens", value, "--model", str(tmp_path / "missing.gguf")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--max-tokens" in r.stderr and "missing.gguf" not in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["call", "generate"])
@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_an_empty_prompt_is_refused_before_the_model_loads(tmp_path, command, prompt):
    extra = ["--tools", str(tmp_path / "none.json")] if command == "call" else []
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", command, *extra, "--prompt", prompt,
                        "--model", str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "missing.gguf" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith("argument --prompt: the user message is empty"), r.stderr


@pytest.mark.parametrize("command", ["call", "generate", "serve"])
def test_a_bad_threads_is_a_usage_error_before_the_model_loads(tmp_path, command):
    extra = {"call": ["--tools", str(ROBOT_TOOLS), "--prompt", "hi"], "generate": ["--prompt", "hi"], "serve": []}
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", command, *extra[command], "--threads", "0",
                        "--model", str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "missing.gguf" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last == f"tokenspeed {command}: error: argument --threads: 0 is not a positive integer", r.stderr


@pytest.mark.slow  # loads the real model (~30 s on 2 busy cores)
def test_call_under_auto_that_answers_in_text_exits_0():
    # a question no robot tool applies to: the model answers in text (status "text"), a valid outcome
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "call", "--tools", str(ROBOT_TOOLS), "--tool-choice",
                        "auto", "--system", "You control a robot arm.", "--prompt", "What is the capital of France?",
                        "--max-tokens", "32"], capture_output=True, text=True, timeout=600)
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["status"] == "text" and report["text"], (r.returncode, r.stdout, r.stderr)
    # the prompt's own tokens, prefilled by observe before the decision (whose prefill is its trigger's)
    assert report["timings"]["observe_prefill_tokens"] > report["timings"]["prefill_tokens"] > 0, report["timings"]


def test_serve_refuses_bad_option_values_with_exit_2():
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "serve", "--model", "tiny-random", "--context", "8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith("error: --queue-size must be"), r.stderr


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_refuses_a_port_out_of_range_with_one_usage_error(tmp_path, port):
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "serve", "--port", port,
                        "--model", str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines()[-1].startswith("tokenspeed serve: error: argument --port:"), r.stderr
    assert "missing.gguf" not in r.stderr, r.stderr


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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_on_a_signal_with_one_line_and_exit_0(sig):
    proc = subprocess.Popen([sys.executable, "-m", "tokenspeed.cli", "serve", "--model", "tiny-random", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        while line and "serving on" not in line:
            line = proc.stdout.readline()
        assert "serving on" in line, proc.stderr.read()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, (proc.returncode, err)
    assert "Traceback" not in err, err
    assert out.strip() == f"# tokenspeed serve: stopped ({sig.name})", out


def _default_sigint():
    """preexec_fn: SIGINT's default action in the child. A pytest started with `&` from a non-interactive
    shell ignores SIGINT, the child would inherit that and never see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_ctrl_c_while_torch_imports_is_one_line_and_exit_130(tmp_path, command):
    # -X importtime prints a line as each module finishes importing: the first torch submodule's line
    # means `import torch` is under way (it takes seconds), so the SIGINT lands inside it.
    extra = ["--prompt", "hi"] if command == "generate" else []
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "tokenspeed.cli", command, *extra,
                             "--model", str(tmp_path / "missing.gguf")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.split("|")[-1].strip().startswith("torch."):
                break
        assert proc.poll() is None, "".join(seen)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    own = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 130 and out == "", (proc.returncode, err)
    assert own == [f"# tokenspeed {command}: interrupted (SIGINT)"], own


def test_serve_interrupted_while_the_model_loads_is_one_line_and_exit_130(tmp_path):
    # The "model" is a named pipe: the load blocks reading it (hashing the file) until the test
    # interrupts it. The test knows the load reached the file when opening the pipe's write end
    # without blocking succeeds (it fails with ENXIO while no reader has it open).
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "tokenspeed.cli", "serve", "--model", str(fifo), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint,
                            env={**os.environ, "TOKENSPEED_CACHE": str(tmp_path / "cache")})
    writer = None
    try:
        deadline = time.monotonic() + 120
        while writer is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                assert exc.errno == errno.ENXIO
                time.sleep(0.05)
        assert writer is not None, proc.communicate(timeout=10)
        proc.send_signal(signal.SIGINT)
        # The kernel may hand SIGINT to any thread of the process (torch starts several): Python's handler
        # then only flags it, and the main thread stays blocked reading the pipe (the test hung 3 times in
        # ~11 tries). End that read (EOF) a moment later, as a real file's read ends: the flag is raised there.
        time.sleep(0.5)
        os.close(writer)
        writer = None
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        if writer is not None:
            os.close(writer)
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "# tokenspeed serve: interrupted (SIGINT)", err
    assert "serving on" not in out
