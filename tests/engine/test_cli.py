"""The `tokenspeed` command line: help lists every subcommand, `call` checks the tools before the
model loads, `serve` on a port in use is one error line (exit 1) before the model loads."""
import json
import socket
import subprocess
import sys

from tokenspeed.cli import build_parser


def test_help_lists_every_bench_subcommand():
    text = build_parser().format_help()
    assert "bench kv" in text and "bench aal" in text


def test_call_refuses_bad_tools_before_loading_the_model(tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "bad name!", "parameters": {}}}]))
    # A model path that does not exist: had the model been loaded first, the error would be about it.
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "call", "--tools", str(tools), "--prompt", "hi",
                        "--model", str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "bad name!" in r.stderr and "missing.gguf" not in r.stderr, r.stderr
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "hold", "parameters": {}}}]))
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "call", "--tools", str(tools), "--prompt", "hi",
                        "--tool", "grasp", "--model", str(tmp_path / "missing.gguf")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "'grasp' is not in" in r.stderr and "missing.gguf" not in r.stderr, r.stderr


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
