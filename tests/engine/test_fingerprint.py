"""The model fingerprint prefill and decode compare (in their KV layouts) covers the
tokenizer.json, and the tokenizer file's sha256 is the one the tokenizer service publishes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mili.engine.model.checkpoint import write_random_checkpoint
from mili.engine.model.config import Qwen3Config
from mili.engine.model.fingerprint import model_fingerprint, tokenizer_file_sha256
from services.tokenizer.tokenizer import ModelTokenizer


def test_another_tokenizer_file_is_another_model(demo_model_dir: Path, tmp_path: Path) -> None:
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(demo_model_dir, same)
    shutil.copytree(demo_model_dir, other)
    tokenizer_json = other / "tokenizer.json"
    tokenizer_json.write_text(json.dumps(json.loads(tokenizer_json.read_text()), indent=1))
    assert model_fingerprint(same) == model_fingerprint(demo_model_dir)
    assert model_fingerprint(other) != model_fingerprint(demo_model_dir)
    assert tokenizer_file_sha256(other) != tokenizer_file_sha256(demo_model_dir)


def test_other_weights_of_one_config_are_another_model(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """A fine-tune of the same config: the headers match, the data does not (before, only the
    headers were hashed and such checkpoints paired, their KV giving wrong tokens)."""
    config = Qwen3Config.from_file(demo_model_dir / "config.json")
    one = write_random_checkpoint(tmp_path / "one", config, seed=3)
    again = write_random_checkpoint(tmp_path / "again", config, seed=3)
    other = write_random_checkpoint(tmp_path / "other", config, seed=4)
    assert model_fingerprint(one) == model_fingerprint(again)
    assert model_fingerprint(one) != model_fingerprint(other)


def test_the_sha256_is_the_tokenizer_services(demo_model_dir: Path, tmp_path: Path) -> None:
    service = ModelTokenizer(demo_model_dir)
    assert tokenizer_file_sha256(demo_model_dir) == service.file_sha256
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    assert tokenizer_file_sha256(bare) == ""
