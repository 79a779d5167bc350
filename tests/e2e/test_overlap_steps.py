"""The pipeline's tests again, with decode's steps overlapped (`serve-decode --overlap-steps on`,
CUDA's default; the CPU's is off): separate processes over real gRPC, greedy tokens equal to the
single-process engine, stop strings, cancels and deadlines that end requests mid-flight."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import DECODE_ARGS, Deployment, ServiceProcess, deploy
from tests.e2e.test_pipeline import (  # noqa: F401 - fixtures and tests, run on this deployment
    prompts,
    reference,
    test_chat_prompt_and_stop_string,
    test_client_cancel_frees_every_block,
    test_deadline_is_deadline_exceeded_and_frees_every_block,
    test_greedy_tokens_equal_reference_with_8_concurrent_requests,
    test_greedy_tokens_equal_single_process_reference,
    test_hot_sampling_returns_only_ids_the_tokenizer_has,
)


@pytest.fixture(scope="module")
def deployment(demo_model_dir: Path, e2e_tokenizer: ServiceProcess) -> Iterator[Deployment]:
    d = deploy(
        demo_model_dir,
        e2e_tokenizer,
        engine_args=("--dtype", "float32"),
        decode_args=(*DECODE_ARGS, "--overlap-steps", "on"),
    )
    yield d
    d.stop()


def test_decode_says_its_steps_overlap(deployment: Deployment) -> None:
    (decode,) = deployment.decodes
    assert "steps overlapped" in decode.stderr, decode.stderr
