"""Reading a PTX directory's manifest.json, for both GPU loaders (kernels/gpu.py,
kernels/fused/gpu.py).

Each build writes its own manifest (kernels/ptx.py, kernels/fused/ptx.py) and numbers its own
format, so a loader passes the format it expects. No torch import.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_manifest(kernel_dir: Path, manifest_format: int) -> dict:
    """kernel_dir/manifest.json; FileNotFoundError when it is missing, RuntimeError when it has
    another format than `manifest_format` (PTX built by another version of its build)."""
    path = Path(kernel_dir) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: build it with "
            "`mili kernels build --gpu` on a machine with the Mojo toolchain"
        )
    manifest: dict = json.loads(path.read_text())
    if manifest.get("format") != manifest_format:
        raise RuntimeError(
            f"{path}: manifest format {manifest.get('format')}, "
            f"expected {manifest_format}; rebuild the PTX"
        )
    return manifest
