"""Tiny random-weight Qwen3 checkpoints on disk, loaded by our engine and by HF transformers.

torch is imported by the fixtures, not here: the bookkeeping tests of this folder (block pool,
prefix cache) run without it (tests/test_layers.py)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from mili.engine.model.config import Qwen3Config

if TYPE_CHECKING:
    from mili.engine.model.qwen3 import Qwen3ForCausalLM

# std 0.1 (not HF's 0.02) makes logits peaked enough that greedy argmax never sits on a near-tie
# that float noise between two correct implementations could flip.
STD = 0.1

CONFIGS = {
    # Tied embeddings, GQA ratio 2, head_dim 32 != hidden / heads = 16.
    "tied_gqa2": Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
        torch_dtype="float32",
        eos_token_id=1,
    ),
    # Separate lm_head, GQA ratio 4, head_dim 16 != hidden / heads = 8, three layers.
    "untied_gqa4": Qwen3Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
        eos_token_id=[1, 2],
    ),
    # attention_bias: q/k/v/o biases (merged into qkv_proj's bias like the weights).
    "bias_gqa2": Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_theta=10_000.0,
        tie_word_embeddings=False,
        attention_bias=True,
        torch_dtype="float32",
    ),
    # YaRN as Qwen3's recipe sets it (40960 positions beside 4 x 32768), at 1/1024 scale: the
    # context is 4 x 32 = 128, past max_position_embeddings 40, so the 100-token prompt is
    # past both the original context and max_position_embeddings.
    "yarn": Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=40,
        rope_theta=10_000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        tie_word_embeddings=False,
        torch_dtype="float32",
    ),
}


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from mili.engine.model.checkpoint import write_random_checkpoint  # torch

    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: write_random_checkpoint(root / name, config, seed=1, std=STD)
        for name, config in CONFIGS.items()
    }


@pytest.fixture(scope="session")
def engine_models(checkpoint_dirs: dict[str, Path]) -> dict[str, Qwen3ForCausalLM]:
    from mili.engine.model.loader import load_model  # torch

    return {name: load_model(path) for name, path in checkpoint_dirs.items()}


@pytest.fixture(scope="session")
def hf_models(checkpoint_dirs: dict[str, Path]) -> dict[str, Any]:
    """HF transformers' Qwen3ForCausalLM on the same files (eager attention: tightest match)."""
    import torch

    transformers = pytest.importorskip("transformers")
    models: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        for name, path in checkpoint_dirs.items():
            model = transformers.Qwen3ForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            )
            models[name] = model.eval()
    return models
