"""Where the engine keeps what it builds and converts: one cache folder, passed down to the kernels."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["cache_dir", "cache_entry"]


def cache_dir() -> Path:
    """Root of the converted-model and compiled-kernel cache (`$TOKENSPEED_CACHE`, else the
    platform user cache)."""
    env = os.environ.get("TOKENSPEED_CACHE")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("tokenspeed"))


def cache_entry(kind: str, *parts: bytes | str) -> Path:
    """`cache_dir()/kind/<first 24 hex digits of the SHA-256 of parts>`: the path of a cache entry keyed
    by its content (the parts: everything the entry is made from, so a changed input is a new entry,
    never a stale hit). The path only; nothing is created."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little") + data)  # length-prefixed: ("ab", "c") != ("a", "bc")
    return cache_dir() / kind / h.hexdigest()[:24]
