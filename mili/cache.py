"""Where MILI keeps what it builds once per machine: the demo model and the compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$MILI_CACHE_DIR, else $XDG_CACHE_HOME/mili, else ~/.cache/mili."""
    env = os.environ
    if env.get("MILI_CACHE_DIR"):
        return Path(env["MILI_CACHE_DIR"])
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "mili"
