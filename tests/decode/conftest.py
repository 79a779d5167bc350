"""Fixtures of the decode tests: a tiny checkpoint, a decode server on it, a stand-in prefill.

pytest-asyncio is not a dependency: each test runs its client with `asyncio.run(...)` against a
server whose event loop lives in a background thread.

torch and grpc are imported by the fixtures, not here: the request table's tests run without
them (tests/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from mili.engine.model.config import Qwen3Config

if TYPE_CHECKING:
    from services.decode.config import DecodeConfig
    from tests.decode.harness import DecodeServerThread, PrefillPlayer

BLOCK_SIZE = 8
NUM_BLOCKS = 128
MAX_RUNNING = 10

# Tied embeddings, GQA 2, head_dim 32 != 64 / 4. std 0.1 makes logits peaked enough that greedy
# argmax never sits on a near-tie that batch-size-dependent float rounding could flip.
TINY = Qwen3Config(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rope_theta=10_000.0,
    tie_word_embeddings=True,
    torch_dtype="float32",
    eos_token_id=1,
)


def tiny_decode_config(model_dir: Path, overlap_steps: str) -> DecodeConfig:
    """The decode_server's configuration, steps overlapped or not ("on", "off")."""
    from mili.engine.engine_config import EngineConfig
    from services.decode.config import DecodeConfig

    return DecodeConfig(
        model_dir=model_dir,
        engine=EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        max_running=MAX_RUNNING,
        overlap_steps=overlap_steps,
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mili.engine.model.checkpoint import write_random_checkpoint  # torch

    return write_random_checkpoint(tmp_path_factory.mktemp("decode-tiny"), TINY, seed=3, std=0.1)


@pytest.fixture(scope="module")
def player(tiny_model_dir: Path) -> PrefillPlayer:
    from tests.decode.harness import PrefillPlayer  # torch, grpc

    return PrefillPlayer(tiny_model_dir, BLOCK_SIZE)


# Every decode_server test runs twice: each step waiting for the last one's ids (the CPU's
# default) and each step launched before them (CUDA's): the outputs must not differ.
@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "overlap"])
def decode_server(
    tiny_model_dir: Path, request: pytest.FixtureRequest
) -> Iterator[DecodeServerThread]:
    from tests.decode.harness import DecodeServerThread  # torch, grpc

    server = DecodeServerThread(tiny_decode_config(tiny_model_dir, request.param))
    yield server
    server.close()
