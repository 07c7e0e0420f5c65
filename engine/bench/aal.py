"""`tokenspeed bench aal`: the Agent Action Latency benchmark, all engines in one run.

1. Generate (or load) the workload (`workload.py`), tokenize it once with the model's own
   tokenizer and chat template into a job file, so every engine is fed the same token ids.
2. Measure the machine's memory read bandwidth (torch sum over 256 MiB with the run's threads).
3. Run each engine in its own process (`peers.py`): TokenSpeed int4 (the GGUF's Q4_1 codes), the
   same without speculation, and fp32 (the quality guard compares their calls), llama.cpp and
   transformers, same GGUF model, same threads; then the same workload over HTTP through
   `tokenspeed serve` and llama-cpp-python's `llama_cpp.server` (rows "...-http").
4. Summarise, compare, print a rich table, write report.json and aal.png (`report.py`).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..kernels.cpu_decode import selected_variant
from . import report as rep
from .peers import LLAMA_CPP_ENV
from .workload import Workload, build_workload

__all__ = ["ENGINES", "DEFAULT_ENGINES", "LLAMA_CPP_INSTALL", "build_job", "measure_bandwidth", "run_aal", "make_report"]

# "tokenspeed:int4:plain" is TokenSpeed int4 without speculation: the speed-up speculation gives.
# ":http": the same workload through an OpenAI-compatible server process (peers.run_http).
ENGINES = ["tokenspeed:auto", "tokenspeed:int4", "tokenspeed:int4:plain", "tokenspeed:int8", "tokenspeed", "llama.cpp",
           "transformers", "tokenspeed:int4:http", "llama.cpp:http"]
DEFAULT_ENGINES = ["tokenspeed:int4", "tokenspeed:int4:plain", "tokenspeed", "llama.cpp", "transformers",
                   "tokenspeed:int4:http", "llama.cpp:http"]
LLAMA_CPP_INSTALL = ("make peers (llama-cpp-python has no binary wheel here: it builds from source for this CPU, "
                     "~10 min on 2 cores)")
# What `python -m llama_cpp.server` imports besides llama_cpp (llama-cpp-python's "server" extra).
LLAMA_CPP_SERVER_DEPS = ["fastapi", "uvicorn", "sse_starlette", "pydantic_settings", "starlette_context"]
SHORT_SYSTEM = "You are a helpful assistant."
_PEERS = Path(__file__).with_name("peers.py")


def _name(engine: str) -> str:
    return engine.replace(":", "-") if ":" in engine else {"tokenspeed": "tokenspeed-fp32"}.get(engine, engine)


def measure_bandwidth(threads: int, mib: int = 256, repeats: int = 5) -> float:
    """Memory read bandwidth in GB/s: median over `repeats` of a torch sum over `mib` MiB of fp32."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def build_job(wl: Workload, threads: int, cold_turns: list[int]) -> dict:
    """Tokenize the workload for the peers: the exact ids a TokenSpeed session would hold.

    Each message is rendered after the system message with the model's chat template and only
    its own tokens kept (as `tokenspeed.Session` does); the call schema of each decision is the
    one TokenSpeed's grammar enforces.
    """
    import gguf

    from ..grammar import call_schema, normalize_tools, tools_system_prompt
    from ..tokenizer import Tokenizer
    from ..weights import default_model_path, resolve_model

    gguf_path = default_model_path()
    files = resolve_model(None)
    tok = Tokenizer(files.folder)
    tools = normalize_tools(wl.tools)

    def system_message(text):
        return {"role": "system", "content": text}

    def message_ids(system_text, message):
        head = tok.render_chat([system_message(system_text)])
        return tok.encode(tok.render_chat([system_message(system_text), message])[len(head):])

    system_text = tools_system_prompt(wl.system, tools)
    turns = []
    for t in wl.turns:
        chosen = [x["function"] for x in tools
                  if not isinstance(t.tool_choice, dict) or x["function"]["name"] == t.tool_choice["name"]]
        turns.append({"obs_ids": [message_ids(system_text, {"role": o.role, "content": o.content})
                                  for o in t.observations],
                      "schema": call_schema(chosen)})
    reader = gguf.GGUFReader(str(gguf_path))
    return {
        "workload": json.loads(wl.to_json()) | {"tools": tools},
        "threads": threads, "cold_turns": cold_turns, "n_ctx": 8192,
        "model_gguf": str(gguf_path), "hf_folder": str(files.folder),
        "gguf_bytes": int(sum(int(t.n_bytes) for t in reader.tensors)),
        "system_ids": tok.encode(tok.render_chat([system_message(system_text)])),
        "trigger_ids": tok.encode(tok.assistant_prefix), "end_ids": tok.encode(tok.assistant_suffix),
        "stop_ids": tok.stop_ids, "turns": turns,
        "short_system": SHORT_SYSTEM,
        "short_ids": tok.encode(tok.render_chat([system_message(SHORT_SYSTEM), {"role": "user", "content": wl.short_prompt}]))
                     + tok.encode(tok.assistant_prefix),
    }


def run_aal(out_dir: Path, quick: bool = False, seed: int = 0, threads: int = 2, workload: Path | None = None,
            engines: list[str] | None = None, bfcl_dir: str | None = None, timeout_s: float = 1800) -> dict:
    """Run the benchmark and write report.json, aal.png, the workload and each engine's record.

    Args:
        out_dir: output folder (created).
        quick: small workload (tests); a missing llama-cpp-python is then skipped with a note.
        seed: workload seed; workload: load this workload JSON instead of generating one.
        threads: CPU threads for every engine (torch intra-op threads, llama.cpp n_threads).
        engines: subset of `ENGINES` (default `DEFAULT_ENGINES`: TokenSpeed int4 - the GGUF's own
            Q4_1 codes - and fp32 for the quality guard, llama.cpp, transformers).
        timeout_s: per-engine process timeout, seconds.
    Returns:
        the report dict.
    Raises:
        RuntimeError: llama-cpp-python missing in a full run (the message says how to install
            it), or an engine process failed (its stderr tail is in the message).
        ValueError: unknown engine name, or $TOKENSPEED_LLAMA_CPP names a folder without llama_cpp.
    """
    engines = list(engines or DEFAULT_ENGINES)
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engines {unknown}; choose from {ENGINES}")
    notes = []
    prefix = os.environ.get(LLAMA_CPP_ENV)
    if any(e.startswith("llama.cpp") for e in engines) and prefix \
            and not (Path(prefix) / "llama_cpp" / "__init__.py").is_file():
        raise ValueError(f"{LLAMA_CPP_ENV}={prefix} holds no llama_cpp package (make peers-avx2 installs one)")
    for engine in [e for e in engines if e.startswith("llama.cpp")]:
        missing = [] if prefix or importlib.util.find_spec("llama_cpp") else ["llama-cpp-python"]
        if engine.endswith(":http"):
            missing += [m for m in LLAMA_CPP_SERVER_DEPS if importlib.util.find_spec(m) is None
                        and not (prefix and importlib.machinery.PathFinder.find_spec(m, [prefix]))]
        if missing:
            what = f"{_name(engine)} row needs {', '.join(missing)} (" + LLAMA_CPP_INSTALL + ")"
            if not quick:
                raise RuntimeError("the full AAL run: the " + what)
            engines.remove(engine)
            notes.append(f"{_name(engine)} row skipped: " + what)
    if "tokenspeed:int4:http" in engines:
        notes.append("tokenspeed serve streams a call only once it is complete and valid (never a half call): "
                     "its HTTP TTFT is the whole call; llama_cpp.server streams the arguments as they come")
    out_dir.mkdir(parents=True, exist_ok=True)
    wl = Workload.load(workload) if workload else build_workload(seed, quick=quick, bfcl_dir=bfcl_dir)
    wl.save(out_dir / "workload.json")
    n = len(wl.turns)
    cold = sorted({n - 1} if quick else {0, n // 2, n - 1})  # llama.cpp decisions re-run with a reset cache
    job_path = out_dir / "job.json"
    job_path.write_text(json.dumps(build_job(wl, threads, cold)))
    bandwidth = measure_bandwidth(threads)
    runs = {}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for engine in engines:
        out = out_dir / f"run-{_name(engine)}.json"
        print(f"# running {_name(engine)} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(_PEERS), engine, str(job_path), str(out)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        runs[_name(engine)] = json.loads(out.read_text())
        print(f"#   done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    report = make_report(runs, bandwidth, threads, wl, notes)
    rep.write_report(report, out_dir)
    return report


def make_report(runs: dict[str, dict], bandwidth_gbs: float, threads: int, wl: Workload, notes: list[str]) -> dict:
    """The report dict from the engines' records (`peers.Recorder` outputs keyed by engine name)."""
    summary = {name: rep.summarize(r, bandwidth_gbs) for name, r in runs.items()}
    # (each server renders the HTTP rows' prompts its own way: only the token-fed engines must agree)
    firsts = {name: r["turns"][0]["context_tokens"] for name, r in runs.items()
              if r["turns"] and not name.endswith(rep.HTTP)}
    if len(set(firsts.values())) > 1:
        notes = notes + [f"engines saw different first prompts (tokens): {firsts}"]
    return {
        "command": f"tokenspeed bench aal --threads {threads}" + (" --quick" if wl.quick else ""),
        "machine": {"threads": threads, "bandwidth_gbs": bandwidth_gbs, "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "load_avg": os.getloadavg(), "cpu_kernels": selected_variant()},
        "workload": {"seed": wl.seed, "quick": wl.quick, "calls": len(wl.turns),
                     "context_tokens_last": max((s["context_tokens_last"] or 0) for s in summary.values())},
        "summary": summary, "ratios": rep.ratios(summary), "targets": rep.targets(summary),
        "agreement": rep.agreement(runs), "notes": notes,
        "weights": {name: r["weights"] for name, r in runs.items() if r.get("weights")},
    }
