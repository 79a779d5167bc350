"""What a decode instance reads from its checkpoint directory besides the weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mili.engine.model.loader import eos_token_ids
from mili.errors import StartupError
from tests.decode.conftest import TINY


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
