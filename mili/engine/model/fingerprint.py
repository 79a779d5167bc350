"""A short digest that identifies a model: equal fingerprints mean prefill and decode run the same
weights, so KV computed by one is valid for the other."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mili.engine.model.loader import tensor_files


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and each weight file's name, size and safetensors header.

    The header lists every tensor's name, dtype, shape and byte offsets; hashing it (not the
    gigabytes of data) keeps start-up fast while still telling checkpoints apart. Random-weight
    checkpoints of one config with different seeds collide — acceptable: they never meet in
    production, and tests that need to tell them apart compare tokens, not fingerprints.
    """
    digest = hashlib.sha256()
    config = json.loads((model_dir / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    for path in sorted(set(tensor_files(model_dir).values())):
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(path.name.encode())
            digest.update(str(path.stat().st_size).encode())
            digest.update(f.read(min(header_len, 100_000_000)))
    return digest.hexdigest()[:16]
