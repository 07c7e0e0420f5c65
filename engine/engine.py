"""The resident engine: a model and its tokenizer, loaded once, its grammar tokenizer built once (`Engine`);
`Engine.session()` opens the agent sessions (`tokenspeed.session.Session`)."""
from __future__ import annotations

import gc
import json
import os
import threading
import time

import torch

from .device import host_worker, resolve_device, resolve_dtype, resolve_pipeline
from .auto import stored_thresholds
from .grammar import DEFAULT_TOOL_PROMPT, ToolGrammar, call_format_for, normalize_tools
from .kv import KVConfig
from .model import ModelArgs, Transformer
from .paths import cache_dir
from .quant import MODES
from .session import Session
from .stages import LoadStages
from .speculation import SpecConfig
from .tokenizer import Tokenizer, grammar_tokenizer, write_grammar_tokens
from .weights import (ModelLoadError, cache_gguf, gguf_quantized, load_gguf, load_model_files, load_quantized,
                      resolve_model, return_free_heap, save_quantized)

__all__ = ["Engine", "EngineArgumentError", "LoadStages"]


class EngineArgumentError(ValueError, TypeError):
    """An argument of `Engine.load` is invalid (the message names it and what is accepted).

    A ValueError and a TypeError, so callers that caught either before keep working.
    """

# Probe prompts for quantize="auto": a format's greedy tokens after each must equal fp32's.
_AUTO_PROBES = ("The red cube is at x=0.42 y=-0.10 on the table. Pick it up and",
                '{"name": "move_to", "arguments": {"x": 0.31, "y":',
                "Joint positions: [0.12, -0.54, 1.03]. The gripper is open. Next action:")


def _tiny_random(args: ModelArgs) -> Transformer:
    # 2 layers, random weights (seed 0), the embedded model's vocabulary
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                     vocab_size=args.vocab_size, max_seq_len=4096, tie_embeddings=True)
    torch.manual_seed(0)
    net = Transformer(args)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.5 if p.dim() == 1 else 0.05).add_(1.0 if p.dim() == 1 else 0.0)
    return net


def _fp32_model(files) -> Transformer:
    with torch.device("meta"):  # no random init: every weight comes from the checkpoint
        net = Transformer(files.args)
    net = net.to_empty(device="cpu")
    try:
        net.load_hf_state_dict(load_model_files(files))
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{files.folder}: {exc}") from exc
    return net


class Engine:
    """A resident model: weights and tokenizer, loaded once; the grammar tokenizer, built once when first needed.

    Attributes:
        model: the `Transformer` (fp32 by default).
        tokenizer: the `Tokenizer`.
        args: the `ModelArgs`.
        source: what was loaded ("embedded", a path, or "tiny-random").
        load_s: load time in seconds.
        weights: the weight format: "int8", "int4" (quantized) or "gguf" (the file's own blocks), else
            the dtype ("fp32", "bf16", "fp16").
        device: the torch device of the weights, where every tensor of the sessions lives.
        weight_choice: the `tokenspeed.quant.FormatChoice` behind `weights` when loaded with
            quantize="auto" (its timings; None otherwise).
        ll_tokenizer: llguidance's tokenizer for the grammars, built on first use (see the property).
        call_format: the `tokenspeed.grammar.CallFormat` the model's chat template writes tool
            calls in (`call_format_for`): what the grammar constrains and the decision parses.
        load_stages: `LoadStages` of the load (model files, tokenizers, weights, draft model).
        speculation: `tokenspeed.speculation.SpecConfig` new sessions speculate with (default:
            prompt lookup, grammar runs and the shipped draft model when it matches this
            target), or None for plain decoding. Set it before creating sessions.
        pipeline: whether decode steps draft the next chain while their forward runs
            (`tokenspeed.device.resolve_pipeline`: by default on CUDA, off on the CPU). Set it
            before creating sessions.
        host_worker: the thread on which a pipelined CPU engine's host work runs beside each
            decode forward (`tokenspeed.device.host_worker`), or None.
        folder: the model's files (its converted folder for a GGUF), or None (built in memory).
        auto_threshold: {tool prompt: threshold}: tool_choice "auto" calls when p(call) at the
            answer's first position reaches the threshold of the session's tool-listing prompt
            (`tokenspeed.auto`): the model's calibration, read by `load`; none for the prompt:
            the plain masked argmax. Settable; a request may override it.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, source: str, load_s: float = 0.0,
                 weights: str = "fp32", weight_choice=None, load_stages: LoadStages | None = None,
                 pipeline: bool | None = None):
        import llguidance

        self.load_stages = load_stages if load_stages is not None else LoadStages()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.args = model.args
        self.source = source
        self.load_s = load_s
        self.weights = weights
        self.device = model.device
        self.pipeline = resolve_pipeline(self.device, pipeline)
        self.weight_choice = weight_choice
        self._ll_tokenizer = None  # built on first use: `ll_tokenizer`
        self._ll_lock = threading.Lock()
        self.mask_executor = llguidance.LLExecutor(1)  # the sessions' grammar masks along draft chains
        self.call_format = call_format_for(tokenizer.chat_template)  # the family's tool-call format
        self._grammars: dict[tuple, ToolGrammar] = {}
        self.folder = None  # set by `load`
        self.auto_threshold: dict[str, float] = {}  # `load` reads the model's calibration (`tokenspeed.auto`)
        self.speculation = SpecConfig.default(self.model)
        self.load_stages.done("draft model")
        return_free_heap()
        self.load_stages.done("free heap returned")

    @property
    def ll_tokenizer(self):
        """llguidance's tokenizer for this model's grammars (`tokenspeed.tokenizer.grammar_tokenizer`),
        an `llguidance.LLTokenizer`. Built once, on first use rather than by `load`: by a session with
        tools (`session`), else by the first grammar compiled (`grammar`, `json_grammar`); a model used
        without tools or response formats never builds its token trie and mask slices. Thread-safe.

        Raises:
            whatever llguidance raises for a tokenizer it cannot build (the build is tried again at the
            next use).
        """
        return self._build_ll_tokenizer()

    def _build_ll_tokenizer(self):
        # `ll_tokenizer`, built if it is not yet
        with self._ll_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = grammar_tokenizer(self.tokenizer)
            return self._ll_tokenizer

    @property
    def speculation(self) -> SpecConfig | None:
        return self._speculation

    @speculation.setter
    def speculation(self, config: SpecConfig | None) -> None:
        if config is not None and not isinstance(config, SpecConfig):
            raise TypeError(f"Engine.speculation must be a SpecConfig or None, got {type(config).__name__}")
        self._speculation = config

    @property
    def pipeline(self) -> bool:
        return self._pipeline

    @pipeline.setter
    def pipeline(self, on: bool) -> None:
        self._pipeline = bool(on)
        self.host_worker = host_worker(self.device, self._pipeline)

    @classmethod
    def load(cls, model: str | None = None, *, threads: int | None = None,
             dtype: "torch.dtype | str | None" = "auto", device: "str | torch.device | None" = "auto",
             quantize: str | None = "auto", stages: LoadStages | None = None,
             pipeline: bool | None = None) -> "Engine":
        """Load a model and keep it resident.

        Args:
            model: None for the embedded SmolLM2-135M-Instruct, a `.gguf` file, a Hugging Face
                safetensors folder, or "tiny-random" (2 layers, random weights, the embedded
                model's tokenizer: for tests where only shapes matter).
            threads: torch intra-op threads (None leaves torch's default).
            dtype: weight and KV-cache dtype: "auto" (default: bfloat16 on CUDA, float32 on the
                CPU), a name of `tokenspeed.device.DTYPES` ("float32", "bfloat16", ...) or a torch dtype.
            device: "auto" (default: CUDA when `torch.cuda.is_available()`, else the CPU), "cpu",
                "cuda" or "cuda:N" (or a torch.device). Every tensor of the engine's sessions lives there.
            quantize: "auto" (default: a GGUF file with quantized blocks runs them, "gguf", with nothing
                measured and no fp32 copy - the user's quantization is the one that runs; other models
                get the fastest format on this machine whose greedy tokens agree with fp32's, measured
                once and cached, see `tokenspeed.quant.choose_format`; the
                unquantized dtype where the model is not fp32 on the CPU, and for "tiny-random"), None
                (unquantized weights, the reference), "int8" or "int4" for weight-only quantized
                linears (`tokenspeed.quant`; on CUDA through torch's int8 and int4 kernels, bf16
                activations for int4), or "gguf": a GGUF file's own quantization, read from the file
                tensor by tensor without an fp32 copy (`tokenspeed.weights.load_gguf`: Q4_0/Q4_1/Q4_K
                and Q6_K blocks run as they are; CPU, float32). Quantized fp32 CPU weights, and a GGUF
                file's blocks in the kernels' layout, are cached (`tokenspeed.weights.load_quantized`):
                a warm load reads them packed. A first "gguf" load streams the file into that cache
                block by block and reads it back memory-mapped (`tokenspeed.weights.cache_gguf`).
            stages: `LoadStages` to continue (its clock runs on from its last stage), else a new one;
                it becomes `Engine.load_stages`.
            pipeline: draft the next decode step while the forward runs (on the CPU that work then
                runs on a worker thread): True, False, or None (auto: on CUDA only; see
                `tokenspeed.device.resolve_pipeline`).

        Python's cyclic garbage collector is paused during the load, process-wide, and left as it was
        after. The grammar tokenizer is not built here (`ll_tokenizer`).

        Raises:
            EngineArgumentError: model not None, a string or a path; threads not None or a positive
                integer; an unknown quantize mode, or "gguf" for a model that is not a GGUF file or
                off the CPU's float32; pipeline not None or a bool; stages not a LoadStages.
            ModelLoadError: bad path, unsupported file, or a configuration (config.json,
                tokenizer_config.json) this engine cannot run as written (the message names the key).
            DeviceError: a malformed device or dtype, or a CUDA device this machine does not have.
            ValueError: an unknown or unrunnable `$TOKENSPEED_CPU_ISA`.
        """
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise EngineArgumentError(f"model must be None, a path or 'tiny-random', got {type(model).__name__}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise EngineArgumentError(f"threads must be None or a positive integer, got {threads!r:.40}")
        if not isinstance(quantize, (str, type(None))) or quantize not in (None, "auto", "gguf", *MODES):
            raise EngineArgumentError(f"unknown quantization {quantize!r:.40}; choose one of "
                                      f"{('auto', 'gguf', *MODES)} or None")
        if pipeline is not None and not isinstance(pipeline, bool):
            raise EngineArgumentError(f"pipeline must be None, True or False, got {pipeline!r:.40}")
        if stages is not None and not isinstance(stages, LoadStages):
            raise EngineArgumentError(f"stages must be None or a LoadStages, got {type(stages).__name__}")
        # No cyclic collection during the load: with torch imported each full collection walks every object
        # of torch's modules, several times per load (the tokenizer, jinja2's import, the model's modules).
        # The collector's state is restored after; its next collection then walks only the young objects
        # the load kept, not a full one.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return cls._load(model, threads, dtype, device, quantize, stages, pipeline)
        finally:
            if collecting:
                gc.enable()

    @classmethod
    def _load(cls, model, threads, dtype, device, quantize, stages, pipeline) -> "Engine":
        # `load` after its arguments are checked
        model = os.fspath(model) if model is not None else None
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        if threads:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        stages = stages if stages is not None else LoadStages()
        files = resolve_model(None if model == "tiny-random" else model)
        stages.done("resolve model")
        tok = Tokenizer(files.folder)
        write_grammar_tokens(tok)  # a first load's llguidance build from the text: its memory gone before the weights
        stages.done("tokenizer")
        on_cpu = device.type == "cpu" and dtype == torch.float32 and model != "tiny-random"
        if quantize == "auto" and on_cpu and gguf_quantized(files):
            quantize = "gguf"   # the user's quantization runs: nothing to measure against, no fp32 copy
            stages.done("auto weights: the GGUF file's own blocks")
        if quantize == "gguf" and not (on_cpu and files.gguf):
            raise EngineArgumentError(
                f"quantize='gguf' runs a GGUF file's own blocks on the CPU in float32; {model or 'embedded'} is "
                + ("not a .gguf file" if model == "tiny-random" or not files.gguf else f"on {device} in {dtype}")
                + ": use 'int4', 'int8' or None")
        choice = None
        if quantize == "auto" and on_cpu:
            from .quant import cached_format

            probes, identity = [tok.encode(p) for p in _AUTO_PROBES], f"{model or 'embedded'}:{files.folder}"
            choice = cached_format(probes, identity, cache_dir() / "auto_quant.json")
            stages.done("auto weights: cached choice lookup")
        plain = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
        fmt = choice.format if choice else quantize if quantize in (*MODES, "gguf") else plain
        net = load_quantized(files, fmt) if on_cpu and fmt in (*MODES, "gguf") else None
        if net is not None:
            stages.done(f"{fmt} weights from the quantized cache")
        elif fmt == "gguf":
            net = cache_gguf(files)
            if net is not None:
                stages.done("gguf weights streamed to the quantized cache")
            else:  # the cache cannot be written (logged)
                net = load_gguf(files)
                stages.done("gguf weights from the file")
        else:
            net = _tiny_random(files.args) if model == "tiny-random" else _fp32_model(files)
            # off the CPU, quantized weights are made on the device from fp32, then the rest is cast
            cast_after = fmt in MODES and device.type != "cpu"
            net = net.to(device=device, dtype=torch.float32 if cast_after else dtype)
            stages.done(f"{plain} weights")
            if quantize == "auto" and on_cpu and choice is None:
                from .quant import choose_format

                net, choice = choose_format(net, probes, identity, cache_dir() / "auto_quant.json")
                fmt = choice.format
                stages.done("auto weights: format measured")
            elif fmt in MODES:
                from .quant import quantize as quantize_model

                quantize_model(net, fmt)
                if cast_after:
                    net = net.to(dtype=dtype)
                stages.done(f"quantize {fmt}")
            if on_cpu and fmt in MODES:
                save_quantized(net, files, fmt)
                stages.done("quantized cache written")
        engine = cls(net, tok, source=model or "embedded", weights=fmt, weight_choice=choice, load_stages=stages,
                     pipeline=pipeline)
        engine.folder = files.folder
        engine.auto_threshold = {} if model == "tiny-random" else stored_thresholds(files.folder)
        engine.load_s = time.perf_counter() - t0  # the whole load, the draft model too
        return engine

    def session(self, system: str | None = None, tools=None, capacity: int | None = None,
                kv_budget: "int | KVConfig | None" = None, tool_prompt: str = DEFAULT_TOOL_PROMPT) -> "Session":
        """A new agent session with its own KV cache. A session with tools builds the engine's grammar
        tokenizer if it is not built yet (`ll_tokenizer`, which names what that may raise), so that its
        first decision does not.

        Args:
            system: system prompt text (the tools are rendered after it).
            tools: OpenAI tool definitions (list of dicts), or None.
            capacity: KV cache size in tokens (default: the model's max_seq_len).
            kv_budget: None keeps every token (full cache, up to `capacity`); an int (tokens) or a
                `tokenspeed.kv.KVConfig` bounds the hot KV tier by relevance pruning with a cold
                tier behind it, so the context can grow without limit (`capacity` is ignored).
            tool_prompt: how the tools are listed in the system prompt (`tokenspeed.grammar.TOOL_PROMPTS`).
        Raises:
            ToolSchemaError: a tool definition is invalid (the message names it), or an unknown tool_prompt.
            SessionArgumentError: system not a string or None (or not valid Unicode), capacity not
                None or an integer in [1, max_seq_len], kv_budget not None, a positive integer or a
                KVConfig, a capacity that cannot hold the system prompt and tools, or the KV cache
                (`capacity` tokens, default max_seq_len; the hot tier's budget with kv_budget)
                needs more memory than the device has available.
            ValueError: the KV budget is invalid.
        """
        session = Session(self, system=system, tools=normalize_tools(tools), capacity=capacity, kv_budget=kv_budget,
                          tool_prompt=tool_prompt)
        if session.tools:  # its decisions compile grammars: their tokenizer is built now, not in the first one
            self._build_ll_tokenizer()
        return session

    def grammar(self, tools: list[dict], tool_choice, parallel: bool = False) -> ToolGrammar:
        """Compiled call grammar for (tools, tool_choice, parallel), cached per engine."""
        # default=repr: a tool_choice that is not JSON still reaches the parser, which names it
        key = ("call", json.dumps(tools, sort_keys=True), json.dumps(tool_choice, sort_keys=True, default=repr),
               parallel)
        if key not in self._grammars:
            self._grammars[key] = ToolGrammar.build(self.ll_tokenizer, self.tokenizer.vocab_size, tools, tool_choice,
                                                    parallel, self.call_format)
        return self._grammars[key]

    def json_grammar(self, schema: dict) -> ToolGrammar:
        """Compiled grammar of one JSON value valid under `schema`, cached per engine.

        Raises:
            ToolSchemaError: the schema is invalid or unenforceable (the message names the path).
        """
        key = ("json", json.dumps(schema, sort_keys=True))
        if key not in self._grammars:
            self._grammars[key] = ToolGrammar.json_response(self.ll_tokenizer, self.tokenizer.vocab_size, schema)
        return self._grammars[key]

    def generate(self, prompt: str, **kwargs) -> str:
        """One-shot chat completion of `prompt` in a fresh session (see `Session.generate`)."""
        return self.session().generate(prompt, **kwargs)
