"""`mili serve --device cuda` on one GPU: the KV pools sized from device memory hold 256
concurrent requests of 512 + 128 tokens on Qwen3-0.6B (random weights) without
RESOURCE_EXHAUSTED (the fixed 1 GiB pool of before held 585 blocks: concurrency ~64)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mili.engine.model.checkpoint import cached_random_checkpoint
from mili.engine.model.config import PRESETS
from tests.service_process import ROOT, ServiceProcess

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def servable_0_6b(tmp_path: Path) -> Path:
    """Random Qwen3-0.6B weights (cached) with the demo model's byte-level tokenizer beside
    them (prompts are token ids < 256)."""
    from mili.demo.model import default_model_dir

    weights = cached_random_checkpoint(
        PRESETS["qwen3-0.6b"], "qwen3-0.6b", Path.home() / ".cache" / "mili" / "bench"
    )
    model_dir = tmp_path / weights.name
    model_dir.mkdir()
    for path in weights.iterdir():
        if path.name not in TOKENIZER_FILES:
            (model_dir / path.name).symlink_to(path)
    for name in TOKENIZER_FILES:
        if (default_model_dir() / name).exists():
            (model_dir / name).symlink_to(default_model_dir() / name)
    return model_dir


def test_256_concurrent_requests_of_512_plus_128_tokens(tmp_path: Path) -> None:
    serve = ServiceProcess(
        "serve", "--model", str(servable_0_6b(tmp_path)), "--device", "cuda", "--port", "0",
        "--decode-args", "--max-running 256", "--fail-fast",
        # The prefill queue holds 128 prompts of 512 (its default, 8192 tokens, refuses more).
        "--prefill-args", "--max-queued-tokens 65536",
        timeout_s=600,
    )  # fmt: skip
    try:
        out = tmp_path / "bench.json"
        result = subprocess.run(
            [sys.executable, "-m", "mili", "bench", "--address", serve.address,
             "--concurrency", "256", "--num-requests", "256", "--prompt-tokens", "512",
             "--output-tokens", "128", "--json", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        summary = json.loads(out.read_text())
        assert (summary["num_ok"], summary["num_errors"]) == (256, 0), summary["errors"]
        assert "RESOURCE_EXHAUSTED" not in serve.stderr
        assert "KV pool:" in serve.stderr  # the sizing was logged
    finally:
        serve.terminate()
