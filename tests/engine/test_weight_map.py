"""Merged projections: HF tensor names -> (parameter, rows), loaded exactly, same outputs as HF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from mili.engine.model.checkpoint import SINGLE_FILE, tensor_shapes
from mili.engine.model.loader import load_model
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.model.weight_map import WeightTarget, hf_tensor, weight_map
from tests.engine.conftest import CONFIGS
from tests.engine.test_model_hf import TOL, Runner, hf_logits, max_diff, random_ids


def test_map_of_a_layer() -> None:
    config = CONFIGS["bias_gqa2"]  # 4 q heads, 2 kv heads of 32; intermediate 96
    with torch.device("meta"):
        targets = weight_map(Qwen3ForCausalLM(config))
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    qkv = attn + "qkv_proj."
    W = WeightTarget
    assert targets[attn + "q_proj.weight"] == W(qkv + "weight", slice(0, 128), (128, 64))
    assert targets[attn + "k_proj.weight"] == W(qkv + "weight", slice(128, 192), (64, 64))
    assert targets[attn + "v_proj.weight"] == W(qkv + "weight", slice(192, 256), (64, 64))
    assert targets[attn + "v_proj.bias"] == W(qkv + "bias", slice(192, 256), (64,))
    assert targets[attn + "o_proj.bias"] == W(attn + "o_proj.bias", None, (64,))
    assert targets[mlp + "gate_proj.weight"] == W(
        mlp + "gate_up_proj.weight",
        slice(0, 96),
        (96, 64),
    )
    assert targets[mlp + "up_proj.weight"] == W(
        mlp + "gate_up_proj.weight",
        slice(96, 192),
        (96, 64),
    )
    assert targets["model.norm.weight"] == W("model.norm.weight", None, (64,))
    assert not any("qkv_proj" in name or "gate_up" in name for name in targets)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parts_tile_every_parameter(name: str) -> None:
    """Every row of every parameter is filled by exactly one HF tensor."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(CONFIGS[name])
    assert_parts_tile(model, weight_map(model))


def assert_parts_tile(model: torch.nn.Module, targets: dict[str, WeightTarget]) -> None:
    """Every row (of every expert, for stacked experts) is filled by exactly one HF tensor."""
    filled: dict[str, list[tuple[int, int]]] = {}
    for target in targets.values():
        shape = model.get_parameter(target.parameter).shape
        experts = [target.expert] if target.expert is not None else [-1]
        rows = shape[1] if target.expert is not None else shape[0]
        span = range(rows) if target.rows is None else range(rows)[target.rows]
        filled.setdefault(target.parameter, []).extend((e, r) for e in experts for r in span)
    params = dict(model.named_parameters())
    assert filled.keys() == params.keys()
    for parameter, cells in filled.items():
        shape = params[parameter].shape
        if parameter.endswith(("experts.gate_up_proj", "experts.down_proj")) and any(
            e >= 0 for e, _ in cells
        ):
            want = [(e, r) for e in range(shape[0]) for r in range(shape[1])]
        else:
            want = [(-1, r) for r in range(shape[0])]
        assert sorted(cells) == want, parameter


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_checkpoint_tensor_loads_exactly(name: str, checkpoint_dirs: dict[str, Path]) -> None:
    tensors = load_file(checkpoint_dirs[name] / SINGLE_FILE)
    assert tensors.keys() == tensor_shapes(CONFIGS[name]).keys()
    model = load_model(checkpoint_dirs[name])
    for tensor_name, tensor in tensors.items():
        assert torch.equal(hf_tensor(model, tensor_name), tensor), tensor_name


def test_attention_bias_matches_hf(
    engine_models: dict[str, Qwen3ForCausalLM], hf_models: dict[str, Any]
) -> None:
    """Prefill and teacher-forced decode with q/k/v/o biases, against HF on the same files."""
    model = engine_models["bias_gqa2"]
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    full = random_ids(30, model.config.vocab_size, seed=800)
    ref = hf_logits(hf_models["bias_gqa2"], full)
    runner = Runner(model, block_size=16)
    table = runner.table(20)
    logits = [runner.prefill([full[:20]], [table])]
    logits += [runner.decode([full[p]], [p], [table]) for p in range(20, 30)]
    assert max_diff(torch.cat(logits), ref) < TOL
