"""The tiny random-weight Qwen3 every prefill test runs (see harness.py for the rest).

torch is imported by the fixtures, not here: the scheduler's tests run without it
(tests/test_layers.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.prefill.harness import TinyModel


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    from mili.engine.model.checkpoint import write_random_checkpoint
    from mili.engine.model.fingerprint import model_fingerprint
    from mili.engine.model.loader import load_model
    from tests.prefill.harness import TINY, TinyModel

    path = write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", TINY, seed=3, std=0.1)
    return TinyModel(path, load_model(path), model_fingerprint(path))


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """These models are tiny: one intra-op thread is faster than two spinning on shared cores
    (the event loop, encoder and worker threads already share them). A test module that did
    not import torch (the scheduler's) runs none."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
