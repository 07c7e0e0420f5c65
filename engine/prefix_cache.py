"""System prompt KV on disk: a session's prefilled system prompt and tools, kept in the engine's
cache folder (`<cache>/prefix`, or the folder `$TOKENSPEED_PREFIX_CACHE` names; "off" turns it
off) so that a warm start reads them instead of prefilling them.

An entry is keyed by everything its keys and values depend on: the system prompt's token ids
(prompt, tools, tool prompt and chat template), a fingerprint of the loaded weights (the model
and its weights format), the engine's numerics (the source of the model, kernel and quantization
code, torch's version, the CPU kernel variant, fused or Python path, thread count), the device,
the model's dtype and the KV cache's (fp16 on the CPU since the fused step stores it so; an entry
of another KV dtype is another key, and reading one into a cache of another dtype is refused as
unreadable). So a restored session holds the same KV, bit for bit, as one prefilled here, and any
change misses. Entries are safetensors files (no pickle), written atomically; the newest
`KEEP` stay (within `KEEP_BYTES`). An unreadable or mismatched entry is treated as a miss (and overwritten).

A session with a draft model (`tokenspeed.speculation.DraftState`) stores the draft's KV of the
same tokens in the entry too (its weights are in the key), so a warm start prefills neither; an
entry without it, or one whose draft KV does not fit, restores the target's and prefills the draft.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import weakref
from pathlib import Path

import numpy as np
import torch

from .paths import cache_dir

__all__ = ["prefill_system", "entry_path", "folder", "KEEP", "PREFIX_ENV"]

PREFIX_ENV = "TOKENSPEED_PREFIX_CACHE"
KEEP = 32  # entries kept, most recently used first (each ~23 KB per token for SmolLM2-135M's fp16 KV)
KEEP_BYTES = 512 << 20  # and while they fit in this many bytes (the newest entry always stays)
_HERE = Path(__file__).parent
# The code whose changes change the numbers of a prefill (an "engine version" finer than the release).
_NUMERICS = ("model.py", "quant.py", "kernels/cpu_kernels.cpp", "kernels/cpu_kernels.h", "kernels/cpu_isa.h",
             "kernels/cpu_decode.cpp", "kernels/cpu_decode.py", "kernels/attention.py", "kernels/norm.py",
             "prefix_cache.py")
log = logging.getLogger(__name__)
_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> weights fingerprint


@functools.cache
def _code_digest() -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for name in _NUMERICS:
        h.update(name.encode() + b"\0" + (_HERE / name).read_bytes())
    return h.hexdigest()


_SAMPLE, _RUNS = 2048, 8  # values of each weight in the fingerprint, in runs of _SAMPLE // _RUNS


def _weights_fingerprint(model) -> str:
    """sha256 of every weight's name, dtype and shape and of a sample of its values (cheap: a few
    KB per tensor, in `_RUNS` contiguous runs spread over it), so that another model or weights
    format gives another digest. Runs, not a stride: a stride maps in every page of a
    memory-mapped weight (`tokenspeed.weights.load_quantized`), the 28 MB embedding table too,
    of which a session otherwise reads only its tokens' rows."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        flat, run = t.detach().reshape(-1), _SAMPLE // _RUNS
        if flat.numel() > _SAMPLE:
            flat = torch.cat([flat[a:a + run] for a in ((flat.numel() - run) * i // (_RUNS - 1) for i in range(_RUNS))])
        sample = flat.to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _key(session, ids: list[int]) -> str:
    model, engine = session.model, session.engine
    if model not in _FINGERPRINTS:  # once per loaded model (a session never changes its weights)
        _FINGERPRINTS[model] = _weights_fingerprint(model)
    fused = model.use_fused and model.fused_decode() is not None
    variant = ""
    if fused:
        from .kernels.cpu_decode import selected_variant

        variant = selected_variant()
    parts = {"ids": hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest(),
             "weights": _FINGERPRINTS[model], "format": engine.weights, "code": _code_digest(),
             "device": str(engine.device), "dtype": str(model.dtype), "kv_dtype": str(session.cache.k.dtype),
             "fused": fused, "variant": variant, "threads": torch.get_num_threads(),
             "cache": type(session.cache).__name__}
    draft = _draft(session)
    if draft is not None:
        if draft.draft.net not in _FINGERPRINTS:
            _FINGERPRINTS[draft.draft.net] = _weights_fingerprint(draft.draft.net)
        parts["draft"] = _FINGERPRINTS[draft.draft.net]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def folder() -> Path | None:
    """Where entries live: `$TOKENSPEED_PREFIX_CACHE`, else `<cache>/prefix`; None when the
    variable is "off" (or "0")."""
    env = os.environ.get(PREFIX_ENV, "").strip()
    if env.lower() in ("off", "0"):
        return None
    return Path(env) if env else cache_dir() / "prefix"


def entry_path(session, ids: list[int]) -> Path | None:
    """The file that holds (or would hold) the KV of `ids` prefilled as `session`'s system prompt
    (None: the disk cache is off)."""
    root = folder()
    return None if root is None else root / f"{_key(session, ids)}.safetensors"


def _draft(session):
    """The session's draft model state (`DraftState`), or None when it drafts without one."""
    return getattr(session.speculator, "draft", None)


def _draft_holds(draft, ids: list[int]) -> bool:
    """Whether `draft`'s cache holds exactly `ids` from rotary position 0 (what an entry stores)."""
    n = len(ids)
    return (draft.offset == draft.anchor == 0 and draft.cache.n == n
            and np.array_equal(draft.tokens[:n], np.asarray(ids, dtype=np.int64)))


def _state(cache, n: int, ids: list[int], draft=None) -> dict[str, torch.Tensor]:
    state = {"k": cache.k[:, :, :, :n], "v": cache.v[:, :, :, :n], "pos": cache.pos[:n],
             "ids": torch.tensor(ids, dtype=torch.long, device="cpu")}
    if cache.tracks_attention:
        state["score"] = cache.score[:n]
    if draft is not None and _draft_holds(draft, ids):
        c = draft.cache
        state.update(draft_k=c.k[:, :, :, :n], draft_v=c.v[:, :, :, :n], draft_pos=c.pos[:n])
    return {name: t.detach().to("cpu").contiguous() for name, t in state.items()}


def _save(path: Path, cache, ids: list[int], draft=None) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_file(_state(cache, len(ids), ids, draft), str(tmp))
    os.replace(tmp, path)
    entries = sorted((st.st_mtime, st.st_size, p) for p in path.parent.glob("*.safetensors")
                     if (st := _stat(p)) is not None)
    total = 0
    for i, (_, size, old) in enumerate(reversed(entries)):   # most recently used first
        total += size
        if i >= KEEP or (i and total > KEEP_BYTES):
            old.unlink(missing_ok=True)


def _stat(path: Path) -> os.stat_result | None:
    # None when another process removed the entry meanwhile
    try:
        return path.stat()
    except OSError:
        return None


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}


class _Unreadable(Exception):
    """An entry that is not the safetensors file `_save` writes (truncated, damaged, another layout)."""


def _header(f) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """The tensors of the safetensors file open as `f`: name -> (dtype, shape, byte offset in the file)."""
    try:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n)) if 2 <= n <= 1 << 20 else None
        header.pop("__metadata__", None)
        return {name: (_DTYPES[t["dtype"]], tuple(t["shape"]), 8 + n + t["data_offsets"][0])
                for name, t in header.items()}
    except (AttributeError, KeyError, TypeError, IndexError, ValueError) as exc:
        raise _Unreadable(f"no safetensors header ({type(exc).__name__}: {exc})") from exc


def _read_into(f, tensors: dict, name: str, dst: torch.Tensor) -> None:
    """Read tensor `name` of the open entry `f` (`_header`) into `dst` (a cache slice [..., n, D], or
    [n]) block by block: from the file into the cache, with no copy of the entry in memory."""
    dtype, shape, at = tensors[name]
    if dtype != dst.dtype or shape != tuple(dst.shape):
        raise _Unreadable(f"{name}: {dtype} {shape} in the entry, {dst.dtype} {tuple(dst.shape)} in the cache")
    blocks = dst.view(-1, *dst.shape[-2:]) if dst.dim() > 2 else dst[None]  # each block contiguous
    f.seek(at)
    for block in blocks:
        host = block if block.device.type == "cpu" else torch.empty_like(block, device="cpu")
        raw = host.view(torch.uint8).numpy()
        if f.readinto(memoryview(raw).cast("B")) != raw.nbytes:
            raise _Unreadable(f"{name}: the file ends early")
        if host is not block:
            block.copy_(host)


def _slots(buffer: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` slots of a cache buffer: k/v [L, B, H, capacity, D] or pos/score [capacity]."""
    return buffer[..., :n, :] if buffer.dim() > 1 else buffer[:n]


def _read_positions(f, tensors: dict, name: str, pos: torch.Tensor, n: int) -> int:
    """Read the entry's `n` positions `name` into the cache's `pos` buffer [capacity] through a host
    copy, and return the next position (last + 1, 0 when n == 0), read on the host: no device sync."""
    host = torch.empty(n, dtype=pos.dtype, device="cpu")
    _read_into(f, tensors, name, host)
    _slots(pos, n).copy_(host)
    return int(host[-1]) + 1 if n else 0


def _load(path: Path, cache, ids: list[int], draft=None) -> tuple[bool, bool]:
    """Write the entry's KV into the empty `cache` (and its draft KV into the empty `draft`'s
    cache); returns whether each was loaded (False: that cache is left empty, its entry does not
    fit or is unreadable). The file is read straight into the caches (a whole-file read first
    held the entry twice: its size again on the session's peak RSS)."""
    n = len(ids)
    try:
        with open(path, "rb") as f:
            tensors = _header(f)
            if "ids" not in tensors or tensors["ids"][1] != (n,) or cache.n or n > cache.capacity \
                    or (cache.tracks_attention and "score" not in tensors):
                return False, False
            # host tensors on the CPU explicitly (a meta or CUDA default device is the cache's, not theirs)
            stored = torch.empty(n, dtype=torch.long, device="cpu")
            _read_into(f, tensors, "ids", stored)
            if not torch.equal(stored, torch.tensor(ids, dtype=torch.long, device="cpu")):
                return False, False
            for name in ["k", "v"] + (["score"] if cache.tracks_attention else []):
                _read_into(f, tensors, name, _slots(getattr(cache, name), n))
            cache.advance(n, _read_positions(f, tensors, "pos", cache.pos, n))
            c = draft.cache if draft is not None else None
            if (c is None or "draft_k" not in tensors or c.n or draft.offset or draft.anchor
                    or n > c.capacity or not n):
                return True, False
            try:
                for name in ("k", "v"):
                    _read_into(f, tensors, f"draft_{name}", _slots(getattr(c, name), n))
                end = _read_positions(f, tensors, "draft_pos", c.pos, n)
            except _Unreadable:
                return True, False  # the draft's cache stays empty (c.n == 0): it is prefilled
            c.advance(n, end)
            draft.tokens[:n] = np.asarray(ids, dtype=np.int64)
            return True, True
    except (OSError, _Unreadable) as exc:
        if not cache.n:  # (the target's KV is not in; what was read into its slots is overwritten)
            log.warning("system prompt KV cache entry %s unreadable (%s): prefilling", path, exc)
            return False, False
        return True, False


def prefill_system(session) -> bool:
    """Prefill `session`'s pending system prompt (its only context so far), from the disk cache
    when an entry matches, else by a forward whose KV is then stored. Leaves the session as its
    own prefill does (`Session._flush`). Returns whether the KV came from disk.

    Disk errors while storing are logged, never raised: the session is ready either way.
    """
    keep = 0 if session.tok.assistant_prefix else 1
    ids = session.pending[:len(session.pending) - keep]
    if not ids or len(session.target.tokens):
        session._flush()
        return False
    # meta tensors (shape-only runs) hold no KV to store
    path = None if session.cache.k.is_meta else entry_path(session, ids)
    if path is None:
        session._flush()
        return False
    draft = _draft(session)
    loaded, draft_loaded = _load(path, session.cache, ids, draft) if path.is_file() else (False, False)
    if loaded:
        session.target.tokens.extend(ids)
        session.pending = session.pending[len(ids):]
        session.cache.trim()
        if not draft_loaded:
            session.speculator.observe(session.target.context())
        try:
            os.utime(path)  # most recently used
        except OSError:     # another process's session evicted it meanwhile: the KV is loaded already
            pass
        return True
    session._flush()
    try:
        _save(path, session.cache, ids, draft)
    except OSError as exc:
        log.warning("cannot store the system prompt KV in %s (%s)", path, exc)
    return False
