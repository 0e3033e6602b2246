"""The prefixserve cache folder: converted models, built kernels, peer weights."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$PREFIXSERVE_CACHE_DIR``, else ``~/.cache/prefixserve``."""
    env = os.environ.get("PREFIXSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prefixserve"
