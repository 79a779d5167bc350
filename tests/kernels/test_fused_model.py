"""The fused-op choice, and the Mojo fused kernels driving the real Qwen3 model.

The torch reference model equals HF transformers (tests/engine/test_model_hf.py); here the model
on the Mojo fused kernels equals the reference model on the same checkpoint: logits within fp32
noise, the same greedy tokens, for tied/untied heads, attention biases and YaRN.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from kernels import build
from kernels.backend import select_fused_ops
from kernels.fused.cpu import CpuFusedKernels
from mili.engine.generate import generate
from mili.engine.model.checkpoint import write_random_checkpoint
from mili.engine.model.config import Qwen3Config
from mili.engine.model.fused_ops import TorchFusedOps
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.loader import load_model
from mili.engine.model.qwen3 import DecodeBatch, PrefillBatch
from mili.engine.sampling_params import SamplingParams

LOGITS_TOL = 1e-4  # fp32, max abs difference of logits (as test_model_hf.py)


def _break_toolchain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))


def test_choice() -> None:
    assert isinstance(select_fused_ops("torch", "cpu", head_dim=128), TorchFusedOps)
    assert isinstance(select_fused_ops("auto", "cpu", head_dim=64), CpuFusedKernels)
    assert isinstance(select_fused_ops("mojo", "cpu", head_dim=128), CpuFusedKernels)
    with pytest.raises(ValueError, match="must be one of auto, mojo, torch"):
        select_fused_ops("fast", "cpu", head_dim=64)


def test_auto_falls_back_to_torch_and_says_why(tmp_path, monkeypatch, caplog) -> None:
    _break_toolchain(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="mili.kernels"):
        ops = select_fused_ops("auto", "cpu", head_dim=64, root=tmp_path)
    assert isinstance(ops, TorchFusedOps)
    assert "Mojo toolchain not found" in caplog.text
    with pytest.raises(build.KernelBuildError, match="Mojo toolchain not found"):
        select_fused_ops("mojo", "cpu", head_dim=64, root=tmp_path)
    # A GPU host without the toolchain needs PTX carried over; without it, the same rule.
    assert isinstance(select_fused_ops("auto", "cuda", head_dim=64, root=tmp_path), TorchFusedOps)
    with pytest.raises(build.KernelBuildError, match="Mojo toolchain not found"):
        select_fused_ops("mojo", "cuda", head_dim=64, root=tmp_path)


def test_unsupported_head_dim(caplog) -> None:
    with pytest.raises(build.KernelBuildError, match="this model has 32"):
        select_fused_ops("mojo", "cpu", head_dim=32)
    with caplog.at_level(logging.WARNING, logger="mili.kernels"):
        assert isinstance(select_fused_ops("auto", "cpu", head_dim=32), TorchFusedOps)


def _config(**overrides: object) -> Qwen3Config:
    fields: dict[str, object] = {
        "vocab_size": 256,
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 512,
        "rope_theta": 10_000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    fields.update(overrides)
    return Qwen3Config(**fields)  # type: ignore[arg-type]


CONFIGS = {
    "tied_gqa2_d64": _config(),
    "untied_gqa4_d128_bias": _config(
        num_attention_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        attention_bias=True,
    ),
    "yarn_d64": _config(
        num_key_value_heads=1,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_model_on_fused_kernels_equals_reference(name: str, tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / name, CONFIGS[name], std=0.1)
    fused = select_fused_ops("mojo", "cpu", head_dim=CONFIGS[name].head_dim)
    logits = {}
    for ops in (TorchFusedOps(), fused):
        model = load_model(path, fused_ops=ops)
        cache = KVCache(model.config, 16, 16)
        # Prefill of 37 + 5 tokens (past YaRN's original 32), then a decode step of both.
        tables = [[3, 0, 7], [5]]
        prompts = [list(range(3, 40)), [9, 8, 7, 6, 5]]
        prefill = model.prefill(PrefillBatch.build(prompts, tables, 16), cache, all_logits=True)
        decode = model.decode(DecodeBatch.build([11, 12], [37, 5], tables, 16), cache)
        logits[ops.name] = (prefill, decode, cache.k[1].clone())
    for reference, actual in zip(logits["torch"], logits["mojo"], strict=True):
        assert (reference - actual).abs().max().item() < LOGITS_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_demo_model_generates_the_same_with_fused_kernels(demo_model_dir: Path, dtype) -> None:
    prompts = [[5, 9, 33, 2, 17] * 7, [101, 7], list(range(40, 90))]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outputs = {}
    for ops in (TorchFusedOps(), select_fused_ops("mojo", "cpu", head_dim=64)):
        model = load_model(demo_model_dir, dtype=dtype, fused_ops=ops)
        results = generate(model, prompts, params, prefill_chunk_size=16)
        outputs[ops.name] = [r.token_ids for r in results]
    if dtype == torch.float32:
        assert outputs["mojo"] == outputs["torch"]
    else:  # bf16 near-ties may flip late tokens; the first ones must agree
        for mojo, ref in zip(outputs["mojo"], outputs["torch"], strict=True):
            assert mojo[:4] == ref[:4]
