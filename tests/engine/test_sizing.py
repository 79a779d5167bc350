"""Weights counted from a config (before loading) and the start-up refusal of a model whose
weights cannot fit on its device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mili.engine.kv_memory import GIB, check_weights_fit
from mili.engine.model.config import PRESETS, Qwen3Config
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.model.sizing import num_active_parameters, num_parameters, weight_bytes
from tests.engine.conftest import CONFIGS
from tests.engine.test_moe import TINY_MOE

GB = 10**9


@pytest.mark.parametrize(
    "config",
    [
        *CONFIGS.values(),
        TINY_MOE,
        dataclasses.replace(TINY_MOE, mlp_only_layers=(0,), tie_word_embeddings=True),
        dataclasses.replace(TINY_MOE, decoder_sparse_step=2, attention_bias=True),
        PRESETS["qwen3-0.6b"],
        PRESETS["qwen3-30b-a3b"],
    ],
)
def test_count_is_the_models(config: Qwen3Config) -> None:
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())


def test_published_sizes() -> None:
    """Qwen's model cards: 30.5B total / 3.3B activated; 235B / 22B."""
    small, big = PRESETS["qwen3-30b-a3b"], PRESETS["qwen3-235b-a22b"]
    assert num_parameters(small) / 1e9 == pytest.approx(30.5, abs=0.2)
    assert num_active_parameters(small) / 1e9 == pytest.approx(3.3, abs=0.2)
    assert num_parameters(big) / 1e9 == pytest.approx(235, abs=1.5)
    assert num_active_parameters(big) / 1e9 == pytest.approx(22, abs=0.5)


def test_235b_is_refused_on_one_80gb_device() -> None:
    big = weight_bytes(PRESETS["qwen3-235b-a22b"], 2)  # bfloat16
    assert big / GIB == pytest.approx(437.9, abs=1.0)
    with pytest.raises(ValueError) as refusal:
        check_weights_fit(big, 80 * GB, 0.9, what="Qwen3-235B-A22B", device="cuda:0")
    message = str(refusal.value)
    assert "437.9 GiB" in message  # what it needs
    assert "67.1 GiB" in message  # what this device gives (0.9 x 74.5 GiB)
    assert "486.6 GiB" in message  # the device it would take at this utilization
    # 30B-A3B in bf16 (56.9 GiB) fits the same device; at 0.5 it does not
    small = weight_bytes(PRESETS["qwen3-30b-a3b"], 2)
    check_weights_fit(small, 80 * GB, 0.9, what="30B", device="cuda:0")
    with pytest.raises(ValueError, match=r"needs 56\.9 GiB"):
        check_weights_fit(small, 80 * GB, 0.5, what="30B", device="cuda:0")
