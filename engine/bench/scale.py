"""`tokenspeed bench scale`: cost against model size and context, TokenSpeed beside llama.cpp on the same files.

1. A random-weight model at the real shape of each size (`SHAPES`: hidden, layers, heads, KV
   heads, FFN, vocabulary, rope theta, tied head, QKV bias of SmolLM2-135M, Qwen2.5-0.5B/1.5B and
   Llama-3.2-3B; and the test shapes of each family, `tiny*`) is written as an F16 GGUF with the
   `gguf` package's writer: weights N(0, 0.02) (N(0, std) where a shape sets it), biases 0, norms 1
   (Qwen3's per-head Q/K norms 1 + N(0, 0.5)), and the embedded model's byte-level BPE tokenizer
   padded with unused tokens up to the shape's vocabulary (ids are fed directly; only the shapes
   matter). Llama-3.2's rope scaling is left out (it changes no cost). Then llama.cpp's own
   quantizer (`agreement.quantized_file`) makes each format (default Q4_K_M and Q8_0). Both are
   cached under `<cache>/scale/`, keyed by the shape's fields and the format.
2. For each size x format x thread count, each engine runs in its own process (`worker`), on the
   same file, the same seeded random ids and threads: TokenSpeed `Engine.load(quantize="gguf")` (the
   file's own blocks; a first, untimed process loads it once so the timed load is the warm one users
   see after the first: its cold load time is kept too, with the peak RSS during `Engine.load`,
   the figure the goal of 1.3x the file's size is about, and the process's peak with the KV cache)
   and llama.cpp (llama-cpp-python `Llama`, n_batch 512). Each measures: load time (TokenSpeed's
   includes its KV cache, as llama.cpp's does, and `load_rss_mb`: the RSS when `Engine.load` began
   and its peak at the load's end, per stage too); prefill ms/token of
   `PREFILL_NEW` tokens into an empty cache (median of `repeats`); ITL (greedy: one token's forward
   and the argmax of its logits) after `CONTEXTS` tokens of context, median of `steps` steps, with
   process CPU ms/token beside it; peak RSS of the process, and its RSS before the load (Python and
   the engine's imports: torch, llama_cpp), so that a missed RSS goal shows the engine's own share.
3. The floor per decode step: bytes of weights the step reads (TokenSpeed: its projections,
   `quant.linear_bytes`; llama.cpp: the file's tensors, the tied head included) / the memory
   bandwidth measured with the same threads (`aal.measure_bandwidth`, `report.floor_ms`).
4. A table on stdout, `report.json` and `scale.png` (ITL against model size, both engines).

Goals (issue 28): ITL <= 1.0x llama.cpp, prefill <= 1.0x, peak RSS <= 1.15x, load <= 1.5x, at every size.

Run as a script (`python scale.py worker ENGINE JOB OUT`) it is one engine's process; the llama.cpp
one imports no torch. Timings are `time.perf_counter()`.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Shape", "SHAPES", "DEFAULT_SIZES", "FORMATS", "CONTEXTS", "PREFILL_NEW", "GOALS", "source_file",
           "model_file", "worker", "run_scale", "make_row", "print_table", "plot", "merge_reports"]

FORMATS = ("Q4_K_M", "Q8_0")
CONTEXTS = (512, 4096)        # tokens of context before the timed decode steps
PREFILL_NEW = (84, 1024)      # new tokens prefilled into an empty cache
QUICK_CONTEXTS, QUICK_NEW = (32, 96), (8, 24)
GOALS = {"itl": 1.0, "prefill": 1.0, "rss": 1.15, "load": 1.5}  # TokenSpeed / llama.cpp, at most
ENGINES = ("tokenspeed", "llama.cpp")


@dataclass(frozen=True)
class Shape:
    """A decoder's shape as its GGUF metadata states it (Hugging Face config names in brackets).

    Attributes: arch ("llama", "qwen2": Q/K/V biases, "qwen3": per-head Q/K norms, or "smollm3":
    Llama's tensors, NoPE layers), dim (hidden_size), layers, heads, kv_heads, ffn
    (intermediate_size), vocab, rope_theta (float), norm_eps (float), tied (tie_word_embeddings),
    head_size (head_dim when it is not dim // heads, as in Qwen3-0.6B; None otherwise; the
    `head_dim` property is the one in force), std (the weights' standard deviation when not 0.02:
    larger makes attention sharp, so that the position and the Q/K norms decide its output).
    """

    arch: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float
    norm_eps: float
    tied: bool = True
    head_size: int | None = None
    std: float | None = None

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape [out, in] or [n]) of every tensor, in file order."""
        d, q, kv = self.dim, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [("token_embd.weight", (self.vocab, d))]
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [(b + "attn_norm.weight", (d,)), (b + "attn_q.weight", (q, d)), (b + "attn_k.weight", (kv, d)),
                    (b + "attn_v.weight", (kv, d))]
            if self.arch == "qwen2":
                out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
            if self.arch == "qwen3":
                out += [(b + "attn_q_norm.weight", (self.head_dim,)), (b + "attn_k_norm.weight", (self.head_dim,))]
            out += [(b + "attn_output.weight", (d, q)), (b + "ffn_norm.weight", (d,)),
                    (b + "ffn_gate.weight", (self.ffn, d)), (b + "ffn_up.weight", (self.ffn, d)),
                    (b + "ffn_down.weight", (d, self.ffn))]
        out.append(("output_norm.weight", (d,)))
        if not self.tied:
            out.append(("output.weight", (self.vocab, d)))
        return out

    def params(self) -> int:
        """Number of weights (the tied head counted once)."""
        n = 0
        for _, shape in self.tensors():
            k = 1
            for s in shape:
                k *= s
            n += k
        return n

    def key(self) -> str:
        """A short digest of every field (those left None omitted: older shapes keep their files' key):
        the cache key of this shape's files."""
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


SHAPES = {
    # the test's shape: Qwen2 (biases), Q4_K-sized rows, two layers
    "tiny": Shape("qwen2", 256, 2, 4, 2, 512, 49152, 1e6, 1e-6),
    # the other families' test shapes (tests/engine/test_families.py): Llama 3.x (GQA, untied head),
    # Qwen3 (Q/K norms, head_dim 128 != 256 / 4 as in Qwen3-0.6B), SmolLM3 (layer 3 is NoPE)
    "tiny-llama": Shape("llama", 256, 2, 4, 2, 512, 49152, 5e5, 1e-5, tied=False, std=0.1),
    "tiny-qwen3": Shape("qwen3", 256, 2, 4, 2, 512, 49152, 1e6, 1e-6, head_size=128, std=0.1),
    "tiny-smollm3": Shape("smollm3", 256, 4, 4, 2, 512, 49152, 5e6, 1e-6, std=0.1),
    # Qwen2.5-0.5B's layout in small (tests/engine/test_families.py): a hidden size that is not whole
    # 256-blocks, so llama.cpp's Q4_K_M stores its rows as Q5_0 (Q8_0 where Q6_K was meant)
    "tiny-0.5b": Shape("qwen2", 320, 2, 5, 1, 512, 49152, 1e6, 1e-6, std=0.1),
    "135m": Shape("llama", 576, 30, 9, 3, 1536, 49152, 1e5, 1e-5),          # SmolLM2-135M
    "0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, 1e6, 1e-6),        # Qwen2.5-0.5B
    "1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 151936, 1e6, 1e-6),       # Qwen2.5-1.5B
    "3b": Shape("llama", 3072, 28, 24, 8, 8192, 128256, 5e5, 1e-5),         # Llama-3.2-3B (without rope scaling)
}
DEFAULT_SIZES = ("135m", "0.5b")


def _folder() -> Path:
    from ..paths import cache_dir

    return cache_dir() / "scale"


def source_file(name: str, seed: int = 0) -> Path:
    """The F16 GGUF of `SHAPES[name]` with random weights (see the module docstring), written on first
    use tensor by tensor (atomic rename) as `<cache>/scale/<name>-<shape key>-s<seed>.gguf`.

    Raises:
        KeyError: an unknown size name.
    """
    import gguf
    import numpy as np

    from ..weights import _gguf_tensors, default_model_path

    shape = SHAPES[name]
    out = _folder() / f"{name}-{shape.key()}-s{seed}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    src: dict = {}  # the embedded model's metadata: its tokenizer, padded to the shape's vocabulary
    _gguf_tensors(default_model_path(), src)
    tokens, types = src["tokenizer.ggml.tokens"], src["tokenizer.ggml.token_type"]
    if shape.vocab < len(tokens):
        raise ValueError(f"{name}: a vocabulary of {shape.vocab} is smaller than the tokenizer's {len(tokens)}")
    pad = shape.vocab - len(tokens)
    w = gguf.GGUFWriter(str(tmp), shape.arch)
    w.add_name(f"tokenspeed scale {name} (random weights)")
    w.add_context_length(8192 if shape.vocab < 100_000 else 32768)
    w.add_embedding_length(shape.dim)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    if shape.head_size:  # as Qwen3's converter states it: key and value lengths, no rotary dimension count
        w.add_key_length(shape.head_size)
        w.add_value_length(shape.head_size)
    else:
        w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.norm_eps)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(src["tokenizer.ggml.pre"])
    w.add_token_list(tokens + [f"<|scale_pad_{i}|>" for i in range(pad)])
    w.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
    w.add_token_merges(src["tokenizer.ggml.merges"])
    w.add_bos_token_id(src["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(src["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(src["tokenizer.chat_template"])
    for tname, tshape in shape.tensors():
        matrix = len(tshape) == 2
        n = tshape[0] * (tshape[1] if matrix else 1)
        w.add_tensor_info(tname, tshape, np.dtype(np.float16 if matrix else np.float32), n * (2 if matrix else 4))
    rng = np.random.default_rng(seed)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for tname, tshape in shape.tensors():
            if tname.endswith(("q_norm.weight", "k_norm.weight")):  # per-head norms 1 + N(0, 0.5): the order
                w.write_tensor_data(1 + 0.5 * rng.standard_normal(tshape, dtype=np.float32))  # norm, rotate matters
                continue
            if len(tshape) == 1:  # norms 1, biases 0
                w.write_tensor_data(np.full(tshape, 1.0 if tname.endswith("norm.weight") else 0.0, np.float32))
                continue
            t = np.empty(tshape, np.float16)
            for r in range(0, tshape[0], 8192):  # N(0, std) in row blocks: no whole fp32 temporary
                block = rng.standard_normal((min(8192, tshape[0] - r), tshape[1]), dtype=np.float32)
                t[r:r + len(block)] = block * (shape.std or 0.02)
            w.write_tensor_data(t)
        w.close()
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def model_file(name: str, fmt: str, threads: int = 2, seed: int = 0) -> Path:
    """`source_file(name, seed)` quantized to `fmt` by llama.cpp's own quantizer, cached beside it.

    Raises:
        RuntimeError: llama-cpp-python is missing or its quantizer failed. ValueError: an unknown format.
    """
    from .agreement import quantized_file

    return quantized_file(fmt, source_file(name, seed), threads=threads, folder=_folder())


# ------------------------------------------------------------------------------------ one engine

def _measure(load, prefill, cut, decode_step, job: dict) -> dict:
    """The timings of one engine: `load()` (timed), then prefill cells into an empty cache and decode
    steps after each context length (see the module docstring). `prefill(ids, pos)`, `cut(n)` (keep
    the first n slots), `decode_step(token, pos) -> next token` (greedy)."""
    ids, repeats, steps = job["ids"], job["repeats"], job["steps"]
    base = _rss_mb()  # the process before the load: Python and the engine's imports (torch / llama_cpp)
    t0 = time.perf_counter()
    extra = load()
    out = {"load_s": time.perf_counter() - t0, "base_rss_mb": base, **extra}
    prefill(ids[:8], 0)  # warm-up: first touch of the weights, kernels built
    cut(0)
    cells = []
    for n in job["new"]:
        times, cpu = [], []
        for _ in range(repeats):
            cut(0)
            t0, c0 = time.perf_counter(), time.process_time()
            prefill(ids[:n], 0)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        cells.append({"new": n, "ms_per_token": statistics.median(times) * 1e3 / n,
                      "cpu_ms_per_token": statistics.median(cpu) * 1e3 / n})
    have = max(job["new"])
    itl = []
    for ctx in job["contexts"]:
        cut(min(have, ctx))
        if ctx > have:
            prefill(ids[have:ctx], have)
        tok, times, c0 = ids[ctx], [], time.process_time()
        for i in range(steps):
            t0 = time.perf_counter()
            tok = decode_step(tok, ctx + i)
            times.append(time.perf_counter() - t0)
        itl.append({"context": ctx, "ms": statistics.median(times) * 1e3,
                    "cpu_ms_per_token": (time.process_time() - c0) * 1e3 / steps})
        have = ctx
        cut(ctx)
    out.update(prefill=cells, itl=itl, peak_rss_mb=_peak_rss_mb())
    return out


def _peak_rss_mb() -> float | None:
    # this process's peak RSS (`peers.peak_rss_mb_of`)
    return _peers().peak_rss_mb_of()


def _rss_mb() -> float | None:
    # this process's RSS now (`peers.rss_mb_of`)
    return _peers().rss_mb_of()


def _peers():
    # bench.peers; run as a script (the llama.cpp worker, no torch), this folder is on sys.path
    if __package__:
        from . import peers
    else:
        import peers
    return peers


def _worker_tokenspeed(job: dict, load_only: bool) -> dict:
    import torch

    from tokenspeed import Engine
    from tokenspeed.decode import PREFILL_CHUNK
    from tokenspeed.kernels.cpu_decode import selected_variant
    from tokenspeed.quant import linear_bytes

    torch.set_num_threads(job["threads"])
    state = {}

    def load():
        engine = Engine.load(job["model"], threads=job["threads"], quantize="gguf")
        state["model"] = model = engine.model
        state["cache"] = model.new_cache(max(job["contexts"]) + job["steps"] + 8)
        stages = engine.load_stages
        return {"weights": engine.weights, "cpu_kernels": selected_variant(), "weight_bytes": linear_bytes(model),
                "fused": model.fused_decode() is not None,
                "load_stages": {k: round(v[0], 3) for k, v in stages.items()},
                # the process's RSS when Engine.load began (Python, torch) and its peak at the load's end
                "load_rss_mb": {"before": stages.start_memory[0], "peak": stages.memory[next(reversed(stages))][1],
                                "stages": {k: [round(m) for m in v] for k, v in stages.memory.items()}}
                if stages.start_memory and stages.memory else None}

    if load_only:
        t0 = time.perf_counter()
        res = load()
        return res | {"load_s": time.perf_counter() - t0,
                      "peak_rss_mb": _peak_rss_mb()}

    def prefill(ids, pos):
        for i in range(0, len(ids), PREFILL_CHUNK):
            state["model"](torch.tensor(ids[i:i + PREFILL_CHUNK], dtype=torch.long), pos + i, state["cache"], "last")

    def decode_step(tok, pos):
        return int(state["model"](torch.tensor([tok], dtype=torch.long), pos, state["cache"], "last").argmax())

    return _measure(load, prefill, lambda n: state["cache"].truncate(n), decode_step, job)


def _worker_llamacpp(job: dict) -> dict:
    import numpy as np

    if os.environ.get("TOKENSPEED_LLAMA_CPP"):  # another llama-cpp-python build (see bench.peers)
        sys.path.insert(0, os.environ["TOKENSPEED_LLAMA_CPP"])
    import llama_cpp

    state = {}

    def load():
        state["llm"] = llama_cpp.Llama(model_path=job["model"], n_ctx=max(job["contexts"]) + job["steps"] + 8,
                                       n_threads=job["threads"], n_threads_batch=job["threads"], n_batch=512,
                                       n_ubatch=512, seed=0, verbose=False)
        return {"version": llama_cpp.__version__, "weight_bytes": job["file_bytes"]}

    def prefill(ids, pos):
        state["llm"].n_tokens = pos  # eval() drops the KV cache past n_tokens first
        state["llm"].eval(ids)

    def cut(n):
        state["llm"].n_tokens = n

    def decode_step(tok, pos):
        llm = state["llm"]
        llm.n_tokens = pos
        llm.eval([tok])
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    return _measure(load, prefill, cut, decode_step, job)


def worker(engine: str, job_path: str, out_path: str) -> None:
    """One engine's process: measure and write the record to `out_path` (JSON). `engine`:
    "tokenspeed", "tokenspeed:load" (the load alone: a cold load, caches filled) or "llama.cpp"."""
    job = json.loads(Path(job_path).read_text())
    rec = _worker_llamacpp(job) if engine == "llama.cpp" else _worker_tokenspeed(job, engine.endswith(":load"))
    Path(out_path).write_text(json.dumps(rec))


# ------------------------------------------------------------------------------------ the bench

def _run_worker(engine: str, job: dict, out_dir: Path, tag: str, timeout_s: float) -> dict:
    job_path, out = out_dir / f"job-{tag}.json", out_dir / f"run-{tag}-{engine.replace(':', '-')}.json"
    job_path.write_text(json.dumps(job))
    # this file as a script: the llama.cpp process imports neither torch nor the engine
    cmd = [sys.executable, __file__, "worker", engine, str(job_path), str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(job["threads"])), capture_output=True,
                          text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} on {Path(job['model']).name} (threads {job['threads']}) failed "
                           f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _ratio(a, b) -> float | None:
    return a / b if a and b else None


def make_row(size: str, fmt: str, threads: int, file_info: dict, runs: dict[str, dict], bandwidth_gbs: float) -> dict:
    """One row of the table: both engines' records, TokenSpeed / llama.cpp per figure, each engine's
    floor (`report.floor_ms` of its weight bytes) and the goals met (None where a side is missing). Beside the
    goals' ratios, `engine_rss`: the peaks less each process's RSS before its load (the engine's own memory)."""
    from .report import floor_ms

    ours, theirs = runs.get("tokenspeed"), runs.get("llama.cpp")
    ratios = {}
    if ours and theirs:
        for a, b in zip(ours["prefill"], theirs["prefill"]):
            ratios[f"prefill_{a['new']}"] = _ratio(a["ms_per_token"], b["ms_per_token"])
        for a, b in zip(ours["itl"], theirs["itl"]):
            ratios[f"itl_{a['context']}"] = _ratio(a["ms"], b["ms"])
            ratios[f"itl_cpu_{a['context']}"] = _ratio(a["cpu_ms_per_token"], b["cpu_ms_per_token"])
        ratios["rss"] = _ratio(ours["peak_rss_mb"], theirs["peak_rss_mb"])
        if all(r.get("base_rss_mb") and r["peak_rss_mb"] for r in (ours, theirs)):
            # the peak less the process's RSS before the load (Python and its imports): the engine's own memory
            ratios["engine_rss"] = _ratio(*(r["peak_rss_mb"] - r["base_rss_mb"] for r in (ours, theirs)))
        ratios["load"] = _ratio(ours["load_s"], theirs["load_s"])
    met = {goal: (all(v <= bound for k, v in ratios.items() if k.startswith(goal) and "cpu" not in k and v is not None)
                  if ratios else None) for goal, bound in GOALS.items()}
    return {"size": size, "params": SHAPES[size].params(), "format": fmt, "threads": threads, **file_info,
            "bandwidth_gbs": bandwidth_gbs,
            "floor_ms": {name: floor_ms(r.get("weight_bytes"), bandwidth_gbs) for name, r in runs.items()},
            "engines": runs, "ratios": ratios, "met": met}


def run_scale(out_dir: Path, sizes: list[str] | None = None, formats: list[str] | None = None,
              threads: list[int] | None = None, repeats: int = 2, steps: int = 16, quick: bool = False,
              seed: int = 0, timeout_s: float = 3600) -> dict:
    """Write, quantize and measure every size x format x thread count; write report.json and
    scale.png in `out_dir` and return the report.

    Args:
        sizes: names of `SHAPES` (default `DEFAULT_SIZES`). formats: llama.cpp formats (default `FORMATS`).
        threads: thread counts (default [1, 2]).
        repeats: timed prefills per cell (median). steps: timed decode steps per context (median).
        quick: contexts `QUICK_CONTEXTS`, prefills `QUICK_NEW` (the plumbing, for tests).
        seed: the random weights' and ids' seed.
    Returns:
        {"command", "machine", "contexts", "new", "rows": [`make_row`], "goals"}.
    Raises:
        KeyError: an unknown size. ValueError: an unknown format. RuntimeError: llama-cpp-python
        missing, its quantizer failed, or an engine process failed (its stderr tail in the message).
    """
    import random

    import gguf

    from .aal import measure_bandwidth

    sizes, formats, threads = list(sizes or DEFAULT_SIZES), list(formats or FORMATS), list(threads or [1, 2])
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown:
        raise KeyError(f"unknown sizes {unknown}; choose from {', '.join(SHAPES)}")
    contexts, news = (QUICK_CONTEXTS, QUICK_NEW) if quick else (CONTEXTS, PREFILL_NEW)
    out_dir.mkdir(parents=True, exist_ok=True)
    bandwidth = {th: measure_bandwidth(th) for th in threads}
    rows = []
    for size in sizes:
        shape = SHAPES[size]
        rng = random.Random(seed)
        ids = [rng.randrange(0, shape.vocab) for _ in range(max(contexts) + steps + 1)]
        for fmt in formats:
            print(f"# {size} {fmt}: writing and quantizing (cached) ...", file=sys.stderr, flush=True)
            path = model_file(size, fmt, threads=max(threads), seed=seed)
            print(f"# {size} {fmt}: {path}", file=sys.stderr, flush=True)
            types: dict[str, int] = {}
            file_bytes = 0
            for t in gguf.GGUFReader(str(path)).tensors:
                types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
                file_bytes += int(t.n_bytes)
            info = {"file": str(path), "file_mb": path.stat().st_size / 2**20, "types": types}
            cold = None
            for th in threads:
                job = {"model": str(path), "threads": th, "ids": ids, "contexts": list(contexts), "new": list(news),
                       "repeats": repeats, "steps": steps, "file_bytes": file_bytes}
                tag = f"{size}-{fmt}-{th}"
                if cold is None:  # the first load of this file fills the engine's caches
                    cold = _run_worker("tokenspeed:load", job, out_dir, tag, timeout_s)
                runs = {}
                for engine in ENGINES:
                    print(f"#   {engine}, {th} thread(s) ...", file=sys.stderr, flush=True)
                    runs[engine] = _run_worker(engine, job, out_dir, tag, timeout_s)
                runs["tokenspeed"]["cold_load"] = {k: cold[k] for k in ("load_s", "peak_rss_mb", "load_rss_mb")}
                rows.append(make_row(size, fmt, th, info, runs, bandwidth[th]))
    report = {"command": f"tokenspeed bench scale --sizes {','.join(sizes)} --formats {','.join(formats)} "
                         f"--threads {','.join(map(str, threads))}" + (" --quick" if quick else ""),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "load_avg": os.getloadavg(), "bandwidth_gbs": bandwidth},
              "contexts": list(contexts), "new": list(news), "rows": rows,
              "goals": {g: f"TokenSpeed <= {b}x llama.cpp" for g, b in GOALS.items()}}
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    plot(report, out_dir / "scale.png")
    return report


def print_table(report: dict) -> None:
    """One line per size x format x threads: each figure as TokenSpeed / llama.cpp (ratio), the floors,
    then the goals missed."""
    ctx, new = report["contexts"], report["new"]
    head = (f"{'size':5} {'params':>6} {'format':7} {'thr':>3} "
            + " ".join(f"{'ITL@' + str(c) + ' ms':>22}" for c in ctx)
            + f" {'ITL CPU x':>11} {'floor ms':>11} " + " ".join(f"{'prefill ' + str(n) + ' ms/tok':>22}" for n in new)
            + f" {'peak RSS MiB':>20} {'load s':>20}")
    print(f"TokenSpeed / llama.cpp (ratio), wall medians; ITL CPU x: the same ratio in process CPU time per token "
          f"(what other processes on the cores do not inflate); floor: TokenSpeed / llama.cpp weight bytes over the "
          f"bandwidth; load avg {report['machine']['load_avg'][0]:.1f}")
    print(head)

    def pair(a, b, r, fmt=".2f"):
        return f"{a:{fmt}}/{b:{fmt}} ({r:.2f}x)" if r is not None else f"{a:{fmt}}/-"

    for row in report["rows"]:
        ours, theirs = row["engines"]["tokenspeed"], row["engines"].get("llama.cpp")
        rt = row["ratios"]
        cells = [f"{row['size']:5} {row['params'] / 1e6:5.0f}M {row['format']:7} {row['threads']:3d}"]
        for i, c in enumerate(ctx):
            cells.append(f"{pair(ours['itl'][i]['ms'], theirs['itl'][i]['ms'], rt.get(f'itl_{c}')):>22}")
        cells.append(f"{' '.join(f'{v:.2f}' if (v := rt.get(f'itl_cpu_{c}')) else '-' for c in ctx):>11}")
        fl = row["floor_ms"]
        cells.append(f"{fl['tokenspeed']:5.2f}/{fl['llama.cpp']:5.2f}")
        for i, n in enumerate(new):
            cells.append(f"{pair(ours['prefill'][i]['ms_per_token'], theirs['prefill'][i]['ms_per_token'], rt.get(f'prefill_{n}')):>22}")
        cells.append(f"{pair(ours['peak_rss_mb'], theirs['peak_rss_mb'], rt.get('rss'), '.0f'):>20}")
        cells.append(f"{pair(ours['load_s'], theirs['load_s'], rt.get('load')):>20}")
        print(" ".join(cells))
    colds = {(r["size"], r["format"]): (r, c) for r in report["rows"] if (c := r["engines"]["tokenspeed"].get("cold_load"))}
    for (size, fmt), (row, cold) in colds.items():  # one cold load per file, whatever the threads
        mem, mb = cold.get("load_rss_mb"), row["file_mb"]
        if mem:
            print(f"  cold first load {size} {fmt}: {cold['load_s']:.1f} s; peak RSS during Engine.load "
                  f"{mem['peak']:,.0f} MiB = {mem['peak'] / mb:.2f}x the file's {mb:,.0f} MiB ({mem['before']:,.0f} MiB "
                  f"of Python and torch before it; the load's own growth {(mem['peak'] - mem['before']) / mb:.2f}x); "
                  f"the process's peak with the bench's KV cache {cold['peak_rss_mb']:,.0f} MiB")
    for row in report["rows"]:
        missed = [f"{g} (<= {GOALS[g]}x)" for g, ok in row["met"].items() if ok is False]
        if missed:
            e, fl = row["engines"], row["floor_ms"]
            vs_floor = ", ".join(f"{n} {e[n]['itl'][0]['cpu_ms_per_token'] / fl[n]:.1f}x" for n in ENGINES if fl.get(n))
            print(f"  MISSED {row['size']} {row['format']} {row['threads']} thr: {', '.join(missed)}; ITL@{ctx[0]} "
                  f"CPU ms over its floor: {vs_floor}; TokenSpeed reads {fl['tokenspeed'] / fl['llama.cpp']:.2f}x "
                  f"llama.cpp's weight bytes")
            if row["met"]["rss"] is False and row["ratios"].get("engine_rss") is not None:
                own = {n: e[n]["peak_rss_mb"] - e[n]["base_rss_mb"] for n in ENGINES}
                print(f"    peak RSS less the process's before the load (Python and its imports: TokenSpeed "
                      f"{e['tokenspeed']['base_rss_mb']:,.0f}, llama.cpp {e['llama.cpp']['base_rss_mb']:,.0f} MiB): "
                      f"{own['tokenspeed']:,.0f} / {own['llama.cpp']:,.0f} MiB ({row['ratios']['engine_rss']:.2f}x)")


def plot(report: dict, path: Path) -> None:
    """ITL (ms/token) at each context against model size (weights, log scale), both engines, one column
    per thread count: wall medians above, process CPU ms/token below (what a busy machine does not
    inflate), each engine's floor dotted. Needs matplotlib (the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted({r["threads"] for r in report["rows"]})
    fig, axes = plt.subplots(2, len(threads), figsize=(6.5 * len(threads), 9), squeeze=False)
    for col, th in enumerate(threads):
        rows = [r for r in report["rows"] if r["threads"] == th]
        for ax, key, what in ((axes[0][col], "ms", "wall"), (axes[1][col], "cpu_ms_per_token", "CPU")):
            for fmt in sorted({r["format"] for r in rows}):
                line = sorted((r for r in rows if r["format"] == fmt), key=lambda r: r["params"])
                x = [r["params"] for r in line]
                for engine, color in (("tokenspeed", "tab:blue"), ("llama.cpp", "tab:orange")):
                    style = "-" if fmt == "Q4_K_M" else "--"
                    for i, c in enumerate(report["contexts"]):
                        ax.plot(x, [r["engines"][engine]["itl"][i][key] for r in line], style,
                                marker="o" if i == 0 else "s", color=color, alpha=1.0 if i == 0 else 0.55,
                                label=f"{engine} {fmt} ctx {c}")
                    ax.plot(x, [r["floor_ms"][engine] for r in line], ":", color=color, alpha=0.6)
            ax.set_xscale("log")
            ax.set_xlabel("weights (parameters)")
            ax.set_ylabel(f"ITL, {what} ms/token " + ("(median)" if what == "wall" else "(mean over the steps)"))
            ax.set_title(f"{th} thread(s), {what} time; dotted: weight-read floor")
            ax.legend(fontsize=7)
    fig.suptitle(f"{report['command']}  (load avg {report['machine']['load_avg'][0]:.1f})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def merge_reports(reports: list[dict]) -> dict:
    """One report of the rows of several runs (e.g. one size per run), in order: same contexts and prefills.

    Raises:
        ValueError: the runs measured different contexts or prefill lengths.
    """
    first = reports[0]
    if any((r["contexts"], r["new"]) != (first["contexts"], first["new"]) for r in reports):
        raise ValueError("the reports measured different contexts or prefill lengths")
    loads = [r["machine"]["load_avg"][0] for r in reports]
    return first | {"command": " + ".join(r["command"] for r in reports), "rows": [x for r in reports for x in r["rows"]],
                    "machine": first["machine"] | {"load_avg": [max(loads)], "runs": [r["machine"] for r in reports]}}


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    worker(*sys.argv[2:])
