"""Which model parameter, and which rows of it, each HF checkpoint tensor fills.

Checkpoints keep HF's names and shapes; the model merges projections that share an input
(`MergedLinear`), so some tensors land in a slice of a bigger parameter:

    HF tensor (in model.layers.i.)  parameter (in model.layers.i.)  rows
    self_attn.q_proj.weight         self_attn.qkv_proj.weight       [0, H*D)
    self_attn.k_proj.weight         self_attn.qkv_proj.weight       [H*D, (H+KVH)*D)
    self_attn.v_proj.weight         self_attn.qkv_proj.weight       [(H+KVH)*D, (H+2*KVH)*D)
    mlp.gate_proj.weight            mlp.gate_up_proj.weight         [0, I)
    mlp.up_proj.weight              mlp.gate_up_proj.weight         [I, 2*I)
    input_layernorm.weight          input_layernorm.weight          all

(`.bias` likewise when attention_bias is set.) Every other parameter is its own HF tensor.

A Qwen3-MoE layer's experts are stacked per layer (mili/engine/model/moe.py); as published, each
expert e is three tensors, which land in expert e's slice (E experts, I = moe_intermediate_size):

    HF tensor (in model.layers.i.mlp.)   parameter (in ...mlp.)     expert  rows
    experts.{e}.gate_proj.weight [I, H]   experts.gate_up_proj       e       [0, I)
    experts.{e}.up_proj.weight   [I, H]   experts.gate_up_proj       e       [I, 2*I)
    experts.{e}.down_proj.weight [H, I]   experts.down_proj          e       all
    gate.weight                  [E, H]   gate.weight                -       all (the router)

transformers 5 can also hold them already stacked, as `experts.gate_up_proj` [E, 2*I, H] and
`experts.down_proj` [E, H, I] (its parameters' own names): `weight_map(model,
fused_experts=True)` is that layout, where each is the parameter of the same name.

The parts of a merged parameter tile its rows (and experts) exactly, so a checkpoint holding
every HF name fills every parameter completely.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from mili.engine.model.layers import MergedLinear
from mili.engine.model.moe import Experts


class WeightTarget(NamedTuple):
    parameter: str  # name in model.named_parameters()
    rows: slice | None  # rows of the parameter (dim 0, or of the expert) it fills; None: all
    shape: tuple[int, ...]  # the HF tensor's shape
    expert: int | None = None  # a stacked experts parameter: the expert (dim 0) it fills


def weight_map(model: nn.Module, *, fused_experts: bool = False) -> dict[str, WeightTarget]:
    """HF tensor name -> where it goes in `model`, in module order (q, k, v in stacking order;
    expert by expert). `fused_experts`: the experts as stacked tensors (module docstring)."""
    targets: dict[str, WeightTarget] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        parent = prefix.rpartition(".")[0]  # the enclosing module ("...self_attn")
        if isinstance(module, Experts) and not fused_experts:
            targets.update(_expert_targets(module, prefix))
            continue
        for attr, param in module.named_parameters(recurse=False):
            parameter = f"{dot}{attr}"
            if not isinstance(module, MergedLinear):
                targets[parameter] = WeightTarget(parameter, None, tuple(param.shape))
                continue
            for part, rows in module.row_slices().items():
                hf_name = f"{parent}.{part}.{attr}" if parent else f"{part}.{attr}"
                shape = (rows.stop - rows.start, *param.shape[1:])
                targets[hf_name] = WeightTarget(parameter, rows, shape)
    return targets


def _expert_targets(experts: Experts, prefix: str) -> dict[str, WeightTarget]:
    """Each expert's three published tensors -> its slices of the stacked parameters."""
    gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    _, hidden, inter = experts.down_proj.shape
    targets = {}
    for e in range(experts.num_experts):
        targets[f"{prefix}.{e}.gate_proj.weight"] = WeightTarget(
            gate_up, slice(0, inter), (inter, hidden), e
        )
        targets[f"{prefix}.{e}.up_proj.weight"] = WeightTarget(
            gate_up, slice(inter, 2 * inter), (inter, hidden), e
        )
        targets[f"{prefix}.{e}.down_proj.weight"] = WeightTarget(down, None, (hidden, inter), e)
    return targets


def target_view(param: torch.Tensor, target: WeightTarget) -> torch.Tensor:
    """The part of `param` (target.parameter's tensor) that `target`'s HF tensor fills."""
    view = param if target.expert is None else param[target.expert]
    return view if target.rows is None else view[target.rows]


def hf_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The model's values of HF tensor `name` (a view into a merged parameter where merged)."""
    target = weight_map(model)[name]
    return target_view(model.get_parameter(target.parameter), target)


def has_fused_experts(names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensor names hold stacked experts (transformers 5's layout)."""
    return any(name.endswith(".mlp.experts.gate_up_proj") for name in names)
