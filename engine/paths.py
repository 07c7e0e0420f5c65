"""Where the engine keeps what it builds and converts: one cache folder, passed down to the kernels."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """Root of the converted-model and compiled-kernel cache (`$TOKENSPEED_CACHE`, else the
    platform user cache)."""
    env = os.environ.get("TOKENSPEED_CACHE")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("tokenspeed"))
