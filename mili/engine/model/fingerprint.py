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
    """sha256 over config.json, tokenizer.json and each weight file's name, size, safetensors
    header and a sample of its data.

    The header lists every tensor's name, dtype, shape and byte offsets; it tells configs apart
    but not two checkpoints of one config (a base model and its fine-tune, v1 and v2 of one
    fine-tune during a rollout), whose KV would then pair and give wrong tokens. Those differ
    in nearly every weight, so _SAMPLES windows of each file's data tell them apart too, for a
    few MiB of reads instead of the gigabytes of the whole data.
    """
    digest = hashlib.sha256()
    config = json.loads((model_dir / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    digest.update(tokenizer_file_sha256(model_dir).encode())
    for path in sorted(set(tensor_files(model_dir).values())):
        size = path.stat().st_size
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(path.name.encode())
            digest.update(str(size).encode())
            digest.update(f.read(min(header_len, 100_000_000)))
            start = 8 + header_len
            span = max(0, size - start - _WINDOW)
            for i in range(_SAMPLES):
                f.seek(start + span * i // (_SAMPLES - 1))
                digest.update(f.read(_WINDOW))
    return digest.hexdigest()[:16]


# Windows of data read from each weight file, evenly spaced from its first byte to its last.
_SAMPLES = 16
_WINDOW = 4096
