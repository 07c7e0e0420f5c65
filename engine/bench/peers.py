"""The engines of the AAL benchmark, each run in its own process (peak RSS is per engine).

Run as a script so a peer's process imports only what that engine needs (the llama.cpp process
never imports torch); this folder is then first on sys.path, so no module here may share a name
with a standard-library module:

    python engine/bench/peers.py ENGINE JOB.json OUT.json

ENGINE is "tokenspeed" (fp32; "tokenspeed:int4" / "tokenspeed:int8" quantized; a third part
":plain" turns speculation off), "llama.cpp" or "transformers"; "tokenspeed:int4:http" and
"llama.cpp:http" run the same workload over HTTP against a real server process on 127.0.0.1
(`tokenspeed serve`, `python -m llama_cpp.server`) with the official `openai` client (see `run_http`). The llama.cpp process imports the
llama-cpp-python of the environment, or the one in the folder named by $TOKENSPEED_LLAMA_CPP (a
`pip install --target` folder, e.g. an AVX2-only build from `make peers-avx2`) when that is set. JOB.json is written by
`tokenspeed.bench.aal`: the workload, the token ids every
engine feeds (system prompt, each observation, the assistant trigger and end), the call schema
of each decision, the thread count and model paths. OUT.json receives one record per decision plus the short-context
decode measurement (see `Recorder`).

Every engine answers greedily and keeps its own answer in its context, as an agent does.
Timings are `time.perf_counter()` seconds, stored in milliseconds.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

CALL_OPEN, CALL_CLOSE = "<tool_call>[", "]</tool_call>"
LLAMA_CPP_ENV = "TOKENSPEED_LLAMA_CPP"   # a folder holding another llama-cpp-python build (see the module docstring)


def check_call(text: str, tools: list[dict], expect_name: str | None = None) -> tuple[dict | None, bool]:
    """Parse `<tool_call>[{"name", "arguments"}]</tool_call>` and validate it against the tools.

    Returns (call or None, valid): valid means parseable, a known tool, and arguments that
    satisfy its JSON schema (jsonschema Draft 2020-12), and the expected tool when one is given.
    """
    text = text.strip()
    if not (text.startswith(CALL_OPEN) and text.endswith(CALL_CLOSE)):
        return None, False
    try:
        call = json.loads(text[len(CALL_OPEN):-len(CALL_CLOSE)])
    except json.JSONDecodeError:
        return None, False
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict):
        return None, False
    call = {"name": call.get("name"), "arguments": call["arguments"]}
    return call, validate_call(call, tools, expect_name)


def validate_call(call: dict, tools: list[dict], expect_name: str | None = None) -> bool:
    """Whether `call` ({"name", "arguments": dict}) names a known tool (the expected one when
    given) and its arguments satisfy that tool's JSON schema (jsonschema Draft 2020-12)."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if call["name"] not in schemas or (expect_name and call["name"] != expect_name):
        return False
    try:
        jsonschema.validate(call["arguments"], schemas[call["name"]])
    except jsonschema.ValidationError:
        return False
    return True


class Recorder:
    """Collects an engine's per-decision records and writes OUT.json.

    Record keys: turn, expect, text, tool_call, valid, status, context_tokens (before the
    decision), new_prompt_tokens (tokens the engine processed at decision time), output_tokens,
    forwards, forced_tokens, ttft_ms, itl_ms (list), decide_ms, observe_ms, turn_ms; TokenSpeed
    adds decided_tokens (not grammar-forced), draft_tokens and accepted_tokens (speculation; their
    ratio summed over turns is spec_acceptance) and draft_sources {source: [proposed, accepted]}.
    """

    def __init__(self, engine: str, config: str, threads: int):
        self.out = {"engine": engine, "config": config, "threads": threads, "turns": [], "cold_ttft_ms": [],
                    "short_itl_ms": [], "spec_acceptance": None, "load_s": None, "weight_bytes": None}

    def turn(self, **record) -> None:
        self.out["turns"].append(record)

    def short(self, wall: list[float], cpu: list[float]) -> None:
        """Short-context decode: token timestamps, wall (perf_counter) and process CPU (process_time).

        CPU ms per token (all the process's threads) is immune to other processes taking the
        cores, which wall-clock ITL on a shared machine is not.
        """
        self.out["short_itl_ms"] = [_ms(b - a) for a, b in zip(wall, wall[1:])]
        if len(cpu) > 1:
            self.out["short_cpu_ms_per_token"] = _ms(cpu[-1] - cpu[0]) / (len(cpu) - 1)

    def write(self, path: str, peak_rss_mb: float | None = None) -> None:
        """Write OUT.json; peak RSS is this process's unless given (a server process's)."""
        self.out["peak_rss_mb"] = peak_rss_mb or peak_rss_mb_of()
        Path(path).write_text(json.dumps(self.out, indent=1))


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _expected_name(turn: dict) -> str | None:
    choice = turn["tool_choice"]
    return choice.get("name") if isinstance(choice, dict) else None


# ------------------------------------------------------------------------------------- TokenSpeed

def run_tokenspeed(job: dict, out: str, quantize: str | None, speculation: bool = True) -> None:
    """TokenSpeed: one warm session; observations are prefilled by observe() as they arrive
    (timed as observe_ms), then decide() is timed (TTFT, ITL, forwards, jump-forward tokens,
    and with speculation the proposals made and accepted per source)."""
    import torch

    import tokenspeed

    torch.set_num_threads(job["threads"])
    t0 = time.perf_counter()
    engine = tokenspeed.Engine.load(job["model_gguf"], threads=job["threads"], quantize=quantize)
    if not speculation:
        engine.speculation = None
    from tokenspeed.kernels.cpu_decode import selected_variant
    from tokenspeed.quant import linear_bytes

    choice = engine.weight_choice
    weights = f"{engine.weights} weights" + (f" ({choice.describe()})" if choice else "")
    rec = Recorder("tokenspeed" + (f"-{quantize}" if quantize else "-fp32") + ("" if speculation else "-plain"),
                   f"torch {torch.__version__}, {weights}, CPU kernels {selected_variant()}, warm session, "
                   f"jump-forward on, speculation {'on' if speculation else 'off'}", torch.get_num_threads())
    rec.out["load_s"] = time.perf_counter() - t0
    rec.out["weights"] = engine.weights
    rec.out["weight_bytes"] = linear_bytes(engine.model)
    wl = job["workload"]
    session = engine.session(system=wl["system"], tools=wl["tools"])
    for i, turn in enumerate(wl["turns"]):
        t0 = time.perf_counter()
        for o in turn["observations"]:
            session.observe(o["content"], role=o["role"], kind=o["kind"], source=o["source"])
        t1 = time.perf_counter()
        context = session.num_tokens
        d = session.decide(tool_choice=turn["tool_choice"], max_tokens=wl["max_tokens"])
        t2 = time.perf_counter()
        call, valid = check_call(d.text, wl["tools"], _expected_name(turn))
        rec.turn(turn=i, expect=turn["expect"], text=d.text, tool_call=call, valid=valid and d.status == "ok",
                 status=d.status, context_tokens=context,
                 new_prompt_tokens=d.prefill_tokens, output_tokens=d.forced_tokens + d.generated_tokens,
                 forwards=d.forwards, forced_tokens=d.forced_tokens, ttft_ms=_ms(d.ttft_s),
                 itl_ms=[_ms(x) for x in d.itl_s], decide_ms=_ms(t2 - t1), observe_ms=_ms(t1 - t0),
                 turn_ms=_ms(t2 - t0), decided_tokens=d.generated_tokens, draft_tokens=d.draft_tokens,
                 accepted_tokens=d.accepted_tokens, draft_sources=d.draft_sources, drafted_ahead=d.drafted_ahead)
    drafted = sum(t["draft_tokens"] for t in rec.out["turns"])
    if drafted:
        rec.out["spec_acceptance"] = sum(t["accepted_tokens"] for t in rec.out["turns"]) / drafted
    short = engine.session(system=job["short_system"])
    stamps, cpu = [], []

    def stamp(_piece: str) -> None:  # returns None: a true value would end the answer
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())

    short.generate(wl["short_prompt"], max_tokens=wl["short_tokens"], on_token=stamp)
    rec.short(stamps, cpu)
    rec.write(out)


# -------------------------------------------------------------------------------------- llama.cpp

def _gbnf(schema: dict) -> str:
    # The call's JSON schema through llama.cpp's own converter, wrapped in the call markers.
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    body = json_schema_to_gbnf(json.dumps(schema))
    body = body.replace("root ::=", "call-body ::=", 1)
    return f'root ::= "{CALL_OPEN}" call-body "{CALL_CLOSE}"\n{body}'


def run_llamacpp(job: dict, out: str) -> None:
    """llama.cpp via llama-cpp-python: `Llama.generate` on token ids (the same ids as TokenSpeed),
    greedy, its JSON-schema grammar (GBNF from the call schema), and its automatic KV prefix
    reuse within one `Llama` object (observations are processed at decision time). Cold TTFT is
    measured afterwards on selected decisions with the cache reset (full prompt processing).
    With $TOKENSPEED_LLAMA_CPP set, llama_cpp is imported from that folder first."""
    if os.environ.get(LLAMA_CPP_ENV):
        sys.path.insert(0, os.environ[LLAMA_CPP_ENV])
    import llama_cpp
    from llama_cpp import Llama, LlamaGrammar

    threads, n_batch = job["threads"], 512
    t0 = time.perf_counter()
    llm = Llama(model_path=job["model_gguf"], n_ctx=job["n_ctx"], n_threads=threads, n_threads_batch=threads,
                n_batch=n_batch, n_ubatch=n_batch, seed=0, verbose=False)
    rec = Recorder("llama.cpp", f"llama-cpp-python {llama_cpp.__version__} ({Path(llama_cpp.__file__).parent}), Q4_1 GGUF, n_batch={n_batch}, "
                   "GBNF from JSON schema, automatic KV prefix reuse, greedy", threads)
    rec.out["load_s"] = time.perf_counter() - t0
    rec.out["weight_bytes"] = job["gguf_bytes"]
    wl, stop = job["workload"], set(job["stop_ids"])

    def decide(prompt: list[int], schema: dict, max_tokens: int):
        grammar = LlamaGrammar.from_string(_gbnf(schema), verbose=False)
        cached = 0
        for a, b in zip(llm._input_ids[:llm.n_tokens], prompt):
            if a != b:
                break
            cached += 1
        new = len(prompt) - min(cached, len(prompt) - 1)
        t0 = time.perf_counter()
        stamps, ids, text = [], [], ""
        for tok in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, grammar=grammar):
            stamps.append(time.perf_counter())
            if tok in stop:
                break
            ids.append(tok)
            text = llm.detokenize(ids, special=True).decode("utf-8", errors="replace")
            if text.endswith(CALL_CLOSE) or len(ids) >= max_tokens:
                break
        return ids, text, t0, stamps, new, math.ceil(new / n_batch) + len(stamps) - 1

    context = list(job["system_ids"])
    llm.eval(context)  # the static system prompt + tools are cached before the turn, as for TokenSpeed
    prompts = []
    for i, (turn, jt) in enumerate(zip(wl["turns"], job["turns"])):
        t_turn = time.perf_counter()
        for ids in jt["obs_ids"]:
            context += ids
        prompt = context + job["trigger_ids"]
        prompts.append(prompt)
        ids, text, t0, stamps, new, forwards = decide(prompt, jt["schema"], wl["max_tokens"])
        t_end = time.perf_counter()
        call, valid = check_call(text, wl["tools"], _expected_name(turn))
        rec.turn(turn=i, expect=turn["expect"], text=text, tool_call=call, valid=valid,
                 status="ok" if valid else "invalid", context_tokens=len(context), new_prompt_tokens=new,
                 output_tokens=len(ids), forwards=forwards, forced_tokens=0,
                 ttft_ms=_ms(stamps[0] - t0) if stamps else None,
                 itl_ms=[_ms(b - a) for a, b in zip(stamps, stamps[1:])], decide_ms=_ms(t_end - t0),
                 observe_ms=0.0, turn_ms=_ms(t_end - t_turn))
        context = prompt + ids + job["end_ids"]
    for i in job["cold_turns"]:
        if i < len(prompts):
            llm.reset()
            t0 = time.perf_counter()
            next(llm.generate(prompts[i], temp=0.0, top_k=1, repeat_penalty=1.0,
                              grammar=LlamaGrammar.from_string(_gbnf(job["turns"][i]["schema"]), verbose=False)))
            rec.out["cold_ttft_ms"].append({"turn": i, "context_tokens": len(prompts[i]),
                                            "ttft_ms": _ms(time.perf_counter() - t0)})
    llm.reset()
    stamps, cpu = [], []
    for n, _ in enumerate(llm.generate(job["short_ids"], temp=0.0, top_k=1, repeat_penalty=1.0)):
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        if n + 1 >= wl["short_tokens"]:
            break
    rec.short(stamps, cpu)
    rec.write(out)


# ------------------------------------------------------------------------------------------- HTTP

def _server_command(server: str, job: dict) -> tuple[list[str], dict]:
    """The command line (without --port) and environment of `server` ("tokenspeed:QUANT" or "llama.cpp") on 127.0.0.1."""
    threads, model, env = str(job["threads"]), job["model_gguf"], dict(os.environ)
    if server == "llama.cpp":
        if os.environ.get(LLAMA_CPP_ENV):
            env["PYTHONPATH"] = os.pathsep.join([os.environ[LLAMA_CPP_ENV], env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return ([sys.executable, "-m", "llama_cpp.server", "--model", model, "--n_ctx", str(job["n_ctx"]),
                 "--n_threads", threads, "--n_threads_batch", threads, "--n_batch", "512", "--n_ubatch", "512",
                 "--seed", "0", "--verbose", "False", "--host", "127.0.0.1"], env)
    quantize = server.split(":")[1] if ":" in server else "none"
    return ([sys.executable, "-m", "tokenspeed.cli", "serve", "--model", model, "--quantize", quantize or "none",
             "--threads", threads, "--context", str(job["n_ctx"]), "--host", "127.0.0.1"], env)


def peak_rss_mb_of(pid: int | None = None) -> float | None:
    """Peak RSS (VmHWM, Linux /proc) of process `pid` (default: this one), MiB; None where unreadable.

    Not `getrusage().ru_maxrss`: a process started by fork + exec keeps in it the RSS its parent had
    at the fork (a torch-importing parent lent every engine ~500 MiB), while VmHWM starts afresh at exec.
    """
    return _status_mb(pid, "VmHWM")


def rss_mb_of(pid: int | None = None) -> float | None:
    """RSS now (VmRSS, Linux /proc) of process `pid` (default: this one), MiB; None where unreadable."""
    return _status_mb(pid, "VmRSS")


def _status_mb(pid: int | None, key: str) -> float | None:
    # a field of /proc/<pid>/status given in kB, as MiB
    try:
        for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def server_process(cmd: list[str], *, env: dict | None = None, startup_s: float = 600, name: str = "server"):
    """`cmd --port N` (an OpenAI-compatible server: `tokenspeed serve`, `llama_cpp.server`) as a
    child process on a free port of 127.0.0.1: yields (process, base URL) once GET /v1/models
    answers 200, terminates it afterwards (killed when it does not stop within 30 s). Its stdout
    is discarded and its stderr kept in a pipe, so an early exit can say why.

    Raises:
        RuntimeError: the server exited, or did not answer within `startup_s` seconds.
    """
    import socket
    import subprocess

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url, t0 = f"http://127.0.0.1:{port}", time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}): {proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > startup_s:
                raise RuntimeError(f"{name} did not answer within {startup_s} s")
            time.sleep(0.5)
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_http(job: dict, out: str, server: str, startup_s: float = 600) -> None:
    """The workload over HTTP: `server` ("tokenspeed:int4" -> `tokenspeed serve`, "llama.cpp" ->
    llama-cpp-python's `llama_cpp.server`, from $TOKENSPEED_LLAMA_CPP when set) as a real process
    on 127.0.0.1, driven by the official `openai` client as an agent framework drives it: every
    decision is one streaming chat completion carrying the whole conversation so far (system
    prompt, observations as user/tool messages, earlier calls as assistant tool_calls) and the
    tools; each server renders and caches the prompt its own way. Every decision names its tool
    (tool_choice {"type": "function", ...}, the workload's expected tool): llama_cpp.server
    constrains a call to the grammar only for a named tool_choice. Timings are client-side:
    TTFT = request sent -> first chunk carrying content or a tool-call delta; ITL = gaps between
    such chunks (a server that sends a call in one chunk has none); turn = the request's wall time
    (for HTTP the observations travel with the decision). Peak RSS is the server process's.

    Raises:
        RuntimeError: the server exited or did not answer within `startup_s` seconds.
    """
    import openai

    cmd, env = _server_command(server, job)
    t0 = time.perf_counter()
    with server_process(cmd, env=env, startup_s=startup_s, name=f"{server} server") as (proc, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        name = server.replace(":", "-") + "-http"
        rec = Recorder(name, f"{' '.join(Path(c).name if c.startswith('/') else c for c in cmd[1:])}; "
                       "openai client, streaming, whole conversation per request, named tool_choice",
                       job["threads"])
        rec.out["load_s"] = time.perf_counter() - t0
        rec.out["weight_bytes"] = job["gguf_bytes"]
        _http_workload(client, model, job, rec)
        rec.write(out, peak_rss_mb_of(proc.pid))


def _http_workload(client, model: str, job: dict, rec: Recorder) -> None:
    # The decisions of `job` as streaming chat completions (see run_http), then the short decode.
    wl = job["workload"]
    messages: list[dict] = [{"role": "system", "content": wl["system"]}]
    last_call_id = None
    for i, turn in enumerate(wl["turns"]):
        for o in turn["observations"]:
            if o["role"] == "tool" and last_call_id:
                messages.append({"role": "tool", "tool_call_id": last_call_id, "content": o["content"]})
            else:
                messages.append({"role": "user", "content": o["content"]})
        choice = {"type": "function", "function": {"name": turn["expect"]}}
        t0 = time.perf_counter()
        stamps, text, calls, usage = _stream(client, model, messages, wl["max_tokens"], tools=wl["tools"],
                                             tool_choice=choice)
        t_end = time.perf_counter()
        call, valid = None, False
        if calls:
            first = calls[0]
            try:
                call = {"name": first["name"], "arguments": json.loads(first["arguments"])}
                valid = isinstance(call["arguments"], dict) and validate_call(call, wl["tools"], turn["expect"])
            except json.JSONDecodeError:
                pass
        prompt, cached = (usage or {}).get("prompt_tokens"), (usage or {}).get("cached_tokens")
        rec.turn(turn=i, expect=turn["expect"], text=json.dumps(calls) if calls else text, tool_call=call,
                 valid=valid, status="ok" if valid else "invalid", context_tokens=prompt,
                 new_prompt_tokens=prompt - cached if prompt is not None and cached is not None else None,
                 output_tokens=(usage or {}).get("completion_tokens", len(stamps)), forwards=None,
                 forced_tokens=0, ttft_ms=_ms(stamps[0] - t0) if stamps else None,
                 itl_ms=[_ms(b - a) for a, b in zip(stamps, stamps[1:])], decide_ms=_ms(t_end - t0),
                 observe_ms=0.0, turn_ms=_ms(t_end - t0))
        last_call_id = f"call_{i}"
        # content "" rather than null: llama_cpp.server's request model refuses a null content
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": last_call_id, "type": "function", "function": c} for c in calls[:1]]} if calls
            else {"role": "assistant", "content": text})
    short = [{"role": "system", "content": job["short_system"]}, {"role": "user", "content": wl["short_prompt"]}]
    stamps, _, _, _ = _stream(client, model, short, wl["short_tokens"])
    rec.short(stamps, [])


def _stream(client, model: str, messages: list[dict], max_tokens: int, **extra):
    """One greedy streaming chat completion: (stamps of chunks with a payload, text, calls
    [{"name", "arguments": str}], usage {"prompt_tokens", "completion_tokens", "cached_tokens"} or None)."""
    stamps, text, calls, usage = [], "", {}, None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
                                            seed=0, stream=True, stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            usage = {"prompt_tokens": chunk.usage.prompt_tokens, "completion_tokens": chunk.usage.completion_tokens,
                     "cached_tokens": details.cached_tokens if details is not None else None}
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content or delta.tool_calls:
            stamps.append(time.perf_counter())
        text += delta.content or ""
        for tc in delta.tool_calls or ():
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function is not None:  # llama_cpp.server repeats the name in every delta: the first counts
                c["name"] = c["name"] or tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
    return stamps, text, [calls[k] for k in sorted(calls)], usage


# ----------------------------------------------------------------------------------- transformers

def run_transformers(job: dict, out: str) -> None:
    """Hugging Face transformers `generate()`: fp32 eager, greedy, a DynamicCache kept across
    decisions (prefix reuse: only new tokens are processed), stopping at `</tool_call>`. It has
    no grammar: validity of its outputs is counted."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache, StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(job["threads"])
    t0 = time.perf_counter()
    from tokenspeed.weights import fp32_folder, resolve_model

    # a GGUF's fp32 weights are written beside its converted header on first use
    weights = fp32_folder(resolve_model(job["model_gguf"]))
    model = AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32).eval()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(job["hf_folder"]) / "tokenizer.json"))
    rec = Recorder("transformers", f"transformers {transformers.__version__}, fp32 eager, DynamicCache reused "
                   "across decisions, greedy, no grammar (stop at </tool_call>)", torch.get_num_threads())
    rec.out["load_s"] = time.perf_counter() - t0
    rec.out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once
    wl, stop_ids = job["workload"], job["stop_ids"]

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times, self.cpu, self.calls = [], [], 0

        def put(self, value):
            self.calls += 1
            if self.calls > 1:  # the first put is the prompt
                self.times.append(time.perf_counter())
                self.cpu.append(time.process_time())

        def end(self):
            pass

    class StopAtClose(StoppingCriteria):
        def __init__(self, start: int):
            self.start = start

        def __call__(self, input_ids, scores, **kwargs):
            tail = tok.decode(input_ids[0, max(self.start, input_ids.shape[1] - 8):].tolist(), skip_special_tokens=False)
            return torch.tensor([tail.endswith(CALL_CLOSE)])

    def generate(prompt: list[int], cache, max_new: int, min_new: int = 0):
        ids = torch.tensor([prompt])
        streamer = Stamps()
        t0 = time.perf_counter()
        with torch.no_grad():
            res = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                 max_new_tokens=max_new, min_new_tokens=min_new, do_sample=False,
                                 eos_token_id=stop_ids, pad_token_id=stop_ids[0], streamer=streamer,
                                 stopping_criteria=StoppingCriteriaList([StopAtClose(len(prompt))]),
                                 return_dict_in_generate=True)
        new = res.sequences[0, len(prompt):].tolist()
        return [t for t in new if t not in stop_ids], t0, streamer, res.past_key_values

    cache = DynamicCache()
    context = list(job["system_ids"])
    with torch.no_grad():
        model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True)
    for i, (turn, jt) in enumerate(zip(wl["turns"], job["turns"])):
        t_turn = time.perf_counter()
        for ids in jt["obs_ids"]:
            context += ids
        prompt = context + job["trigger_ids"]
        cached = cache.get_seq_length()
        out_ids, t0, streamer, cache = generate(prompt, cache, wl["max_tokens"])
        stamps = streamer.times
        t_end = time.perf_counter()
        text = tok.decode(out_ids, skip_special_tokens=False)
        call, valid = check_call(text, wl["tools"], _expected_name(turn))
        rec.turn(turn=i, expect=turn["expect"], text=text, tool_call=call, valid=valid,
                 status="ok" if valid else "invalid", context_tokens=len(context),
                 new_prompt_tokens=len(prompt) - cached, output_tokens=len(stamps), forwards=len(stamps),
                 forced_tokens=0, ttft_ms=_ms(stamps[0] - t0) if stamps else None,
                 itl_ms=[_ms(b - a) for a, b in zip(stamps, stamps[1:])], decide_ms=_ms(t_end - t0),
                 observe_ms=0.0, turn_ms=_ms(t_end - t_turn))
        context = prompt + out_ids + job["end_ids"]
    n = wl["short_tokens"]
    _, _, streamer, _ = generate(job["short_ids"], DynamicCache(), n, min_new=n)
    rec.short(streamer.times, streamer.cpu)
    rec.write(out)


def main(argv: list[str] | None = None) -> int:
    """Script entry: `peers.py ENGINE JOB.json OUT.json` (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    engine, job_path, out = argv
    job = json.loads(Path(job_path).read_text())
    if engine in ("tokenspeed:int4:http", "llama.cpp:http"):
        run_http(job, out, engine[:-len(":http")])
    elif engine.startswith("tokenspeed"):
        _, quantize, mode = (engine.split(":") + ["", ""])[:3]
        run_tokenspeed(job, out, quantize or None, speculation=mode != "plain")
    elif engine == "llama.cpp":
        run_llamacpp(job, out)
    elif engine == "transformers":
        run_transformers(job, out)
    else:
        print(f"unknown engine {engine!r}: tokenspeed[:auto|:int4|:int8[:plain]], llama.cpp, transformers, "
              "tokenspeed:int4:http or llama.cpp:http", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
