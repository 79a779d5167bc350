"""Fixtures shared by every test folder: the demo checkpoint and real service processes.

Importing this file imports no torch (building the demo checkpoint does, when a test asks for
it): the bookkeeping tests run without torch, grpc or opentelemetry (tests/test_layers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service_process import ServiceProcess


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-kernels",
        action="store_true",
        help="fail, not skip, a test whose Mojo kernels are missing (no CUDA GPU, no PTX of this "
        "source): the GPU check asks for the kernels, and a skip there would hide stale PTX",
    )


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded demo checkpoint, built fresh for this test session."""
    from mili.demo.model import build_demo_model  # torch

    return build_demo_model(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="session")
def demo_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint's Qwen3-MoE sibling (`mili demo-model --moe`), built fresh."""
    from mili.demo.model import build_demo_model  # torch

    return build_demo_model(tmp_path_factory.mktemp("demo-moe-model"), moe=True)


@pytest.fixture(scope="module")
def tokenizer_service(demo_model_dir: Path) -> Iterator[ServiceProcess]:
    """A tokenizer service on the demo model, with small input limits to test them."""
    service = ServiceProcess(
        "serve-tokenizer",
        "--model",
        str(demo_model_dir),
        "--port",
        "0",
        "--max-input-chars",
        "5000",
        "--max-token-ids",
        "4096",
    )
    yield service
    assert service.terminate() == 0, service.stderr
