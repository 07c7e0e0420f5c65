"""The `tokenspeed` command line: help lists every subcommand, `call` checks the tools before the
model loads, `serve` says "serving on" only once the port is bound."""
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


def test_serve_announces_only_after_binding():
    with socket.socket() as taken:  # the port is in use: uvicorn cannot bind, so no "serving on"
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "serve", "--model", "tiny-random",
                            "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "serving on" not in r.stdout + r.stderr and "address already in use" in r.stderr
