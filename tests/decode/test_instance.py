"""What a decode instance reads from its checkpoint directory besides the weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mili.engine.model.loader import eos_token_ids
from mili.errors import StartupError
from tests.decode.conftest import TINY, tiny_decode_config


def test_eos_ids_come_from_generation_config_else_config_json(tmp_path: Path) -> None:
    assert eos_token_ids(tmp_path, TINY) == {1}  # config.json's eos_token_id
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(tmp_path, TINY) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert eos_token_ids(tmp_path, TINY) == {7, 9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert eos_token_ids(tmp_path, TINY) == {1}


def test_eos_ids_outside_the_vocab_stop_start_up(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 999]}))
    with pytest.raises(StartupError, match="999"):
        eos_token_ids(tmp_path, TINY)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_checkpoint_without_usable_weights_is_a_start_up_error(
    tiny_model_dir: Path, tmp_path: Path, role: str
) -> None:
    """Found by a review: no weights file, or a truncated one, was a CheckpointError traceback
    at start-up instead of the one line naming the model directory."""
    from mili.engine.engine_config import EngineConfig
    from services.decode.instance import DecodeInstance
    from services.prefill.config import PrefillConfig
    from services.prefill.instance import PrefillInstance

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 4)  # truncated: no header
    with pytest.raises(StartupError, match=f"cannot load model from {model_dir}"):
        if role == "decode":
            DecodeInstance.load(tiny_decode_config(model_dir, "off"))
        else:
            engine = EngineConfig(block_size=16, num_blocks=64)
            PrefillInstance.load(PrefillConfig(engine=engine), model_dir)
