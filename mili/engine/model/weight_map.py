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
The parts of a merged parameter tile its rows exactly, so a checkpoint holding every HF name
fills every parameter completely.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from mili.engine.model.layers import MergedLinear


class WeightTarget(NamedTuple):
    parameter: str  # name in model.named_parameters()
    rows: slice | None  # rows of the parameter (dim 0) the tensor fills; None: all of it
    shape: tuple[int, ...]  # the HF tensor's shape


def weight_map(model: nn.Module) -> dict[str, WeightTarget]:
    """HF tensor name -> where it goes in `model`, in module order (q, k, v in stacking order)."""
    targets: dict[str, WeightTarget] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        parent = prefix.rpartition(".")[0]  # the enclosing module ("...self_attn")
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


def hf_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The model's values of HF tensor `name` (a view into a merged parameter where merged)."""
    target = weight_map(model)[name]
    param = model.get_parameter(target.parameter)
    return param if target.rows is None else param[target.rows]
