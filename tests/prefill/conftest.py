"""The tiny random-weight Qwen3 every prefill test runs (see harness.py for the rest)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mili.engine.checkpoint import write_random_checkpoint
from mili.engine.fingerprint import model_fingerprint
from mili.engine.loader import load_model
from tests.prefill.harness import TINY, TinyModel


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", TINY, seed=3, std=0.1)
    return TinyModel(path, load_model(path), model_fingerprint(path))


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """These models are tiny: one intra-op thread is faster than two spinning on shared cores
    (the event loop, encoder and worker threads already share them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
