"""benchmarks.presets.random_model: a preset's model made on a device without a checkpoint (how
engine_gpu.py --random-on-device runs Qwen3-30B-A3B), checked here on the CPU with tiny-moe."""

from __future__ import annotations

import torch

from benchmarks.presets import TINY_MOE, random_model
from mili.engine.model.sizing import num_parameters


def test_every_parameter_made_repeatably_in_the_dtype() -> None:
    a = random_model(TINY_MOE, "cpu", torch.bfloat16)
    b = random_model(TINY_MOE, "cpu", torch.bfloat16)
    params = dict(a.named_parameters())
    assert sum(p.numel() for p in params.values()) == num_parameters(TINY_MOE)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params.values())
    assert all(torch.equal(p, q) for p, q in zip(params.values(), b.parameters(), strict=True))
    assert params["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    norm = params["model.norm.weight"].float()
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0  # 1 + N(0, 0.02)
    other = random_model(TINY_MOE, "cpu", torch.bfloat16, seed=1)
    assert not torch.equal(other.model.embed_tokens.weight, a.model.embed_tokens.weight)
