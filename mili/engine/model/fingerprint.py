"""A short digest that identifies a model: equal fingerprints mean prefill and decode run the same
weights and tokenizer, so KV computed by one is valid for the other and a token id means the
same text on both sides."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mili.engine.model.loader import tensor_files


def tokenizer_file_sha256(model_dir: Path) -> str:
    """sha256 of `model_dir`/tokenizer.json (what the tokenizer service publishes for its own
    file: Info.tokenizer_file_sha256); "" without one."""
    path = model_dir / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json, tokenizer.json and each weight file's name, size and
    safetensors header.

    The header lists every tensor's name, dtype, shape and byte offsets; hashing it (not the
    gigabytes of data) keeps start-up fast while still telling checkpoints apart. Random-weight
    checkpoints of one config with different seeds collide — acceptable: they never meet in
    production, and tests that need to tell them apart compare tokens, not fingerprints.
    """
    digest = hashlib.sha256()
    config = json.loads((model_dir / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    digest.update(tokenizer_file_sha256(model_dir).encode())
    for path in sorted(set(tensor_files(model_dir).values())):
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(path.name.encode())
            digest.update(str(path.stat().st_size).encode())
            digest.update(f.read(min(header_len, 100_000_000)))
    return digest.hexdigest()[:16]
