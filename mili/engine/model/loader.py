"""Load an HF Qwen3 checkpoint directory into `Qwen3ForCausalLM`, straight to device and dtype.

Reads `config.json` and either `model.safetensors` or the shards listed in
`model.safetensors.index.json`. The model is built on the `meta` device (no memory), every
expected tensor (HF names: mili/engine/model/weight_map.py) is checked for presence and shape
from the safetensors headers alone, and only then is each parameter materialized from its
memory-mapped file, one tensor at a time, directly on the target device: there is never a second
full copy of the weights in RAM. A merged parameter (q/k/v, gate/up) is allocated once and each
HF tensor is copied into its rows.

Qwen3-MoE checkpoints publish each expert as its own tensors (`mlp.experts.{e}.gate_proj.weight`
...); each layer's stacked expert parameters are allocated on the target device once, at the
first expert tensor read, and every expert tensor is copied into its slice as its shard is read,
shard by shard: host memory holds the mapped shard's pages and one tensor on its way, never a
stacked copy beside the per-expert one. Checkpoints holding the experts already stacked
(transformers 5's `mlp.experts.gate_up_proj`) load parameter for tensor.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from torch import nn

from mili.engine.kv.kv_layout import DTYPES
from mili.engine.model.attention import AttentionBackend
from mili.engine.model.checkpoint import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from mili.engine.model.config import ConfigError, Qwen3Config
from mili.engine.model.fused_ops import FusedOps
from mili.engine.model.kv_cache import TORCH_DTYPES
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.model.weight_map import (
    WeightTarget,
    has_fused_experts,
    target_view,
    weight_map,
)
from mili.errors import StartupError

log = logging.getLogger(__name__)
TOKENIZER_FILE = "tokenizer.json"


class CheckpointError(ValueError):
    """The checkpoint's files are missing, unreadable or disagree with its config (names which)."""


class CheckpointWarning(UserWarning):
    """The checkpoint holds something we ignore, e.g. a tensor the model has no parameter for."""


def load_config(path: Path | str) -> Qwen3Config:
    """The directory's config.json; raises ConfigError naming a missing or bad field."""
    return Qwen3Config.from_file(Path(path) / CONFIG_FILE)


def tokenizer_vocab_size(path: Path | str) -> int | None:
    """How many token ids the directory's tokenizer.json has (added tokens included): the
    number the tokenizer service reports as its vocab_size, and the ids the sampler may draw.
    The model's `vocab_size` counts embedding rows, often padded past it (Qwen3: 151,936 rows
    for 151,669 tokens). None when there is no tokenizer.json (a bare test checkpoint).
    """
    file = Path(path) / TOKENIZER_FILE
    if not file.exists():
        return None
    try:
        # Once at start-up, 1-2 s for a Qwen3-sized vocabulary on a busy 2-core machine (a
        # bare json.load of the file is no faster); the tokenizer service's count, by the same
        # library call.
        return int(Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True))
    except Exception as e:  # the Rust loader raises a bare Exception with a parse message
        raise CheckpointError(f"{file} is not a valid tokenizer file: {e}") from None


def tensor_files(path: Path | str) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it, from the index or the single file's header."""
    root = Path(path)
    index_path = root / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path} is not a valid safetensors index: {e!r}") from None
        files = {name: root / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.exists():
                raise CheckpointError(f"shard {file.name} listed in {index_path} does not exist")
        return files
    single = root / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")
    with _open(single, "cpu") as f:
        return dict.fromkeys(f.keys(), single)


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ConfigError(f"unsupported dtype {name!r}; expected one of {list(DTYPES)}") from None


def load_model(
    path: Path | str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    attention: AttentionBackend | None = None,
    fused_ops: FusedOps | None = None,
) -> Qwen3ForCausalLM:
    """Build the model from `path` on `device` in `dtype` (default: config's torch_dtype)."""
    config = load_config(path)
    target_dtype = dtype if dtype is not None else resolve_dtype(config.torch_dtype)
    files = tensor_files(path)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config, attention, fused_ops)
    expected = weight_map(model, fused_experts=has_fused_experts(files))

    missing = [name for name in expected if name not in files]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise CheckpointError(f"checkpoint {path} is missing tensor(s): {shown}")
    for name in files.keys() - expected.keys():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            # Some tied checkpoints also store the (identical) head; tied means we never read it.
            log.info("ignoring lm_head.weight in %s: embeddings are tied", files[name].name)
            continue
        warnings.warn(
            f"unexpected tensor {name!r} in {files[name].name} is ignored",
            CheckpointWarning,
            stacklevel=2,
        )

    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    # Check every header first so a bad shard fails before we spend time loading the others.
    for file, names in by_file.items():
        with _open(file, "cpu") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"tensor {name} is not in {file.name} (as indexed)")
                stored = f.get_slice(name)
                if stored.get_dtype() not in _FLOAT_DTYPES:
                    raise CheckpointError(
                        f"tensor {name} in {file.name} is stored as {stored.get_dtype()}: "
                        "quantized weights are not supported (they would load without their "
                        "scales); serve the bfloat16 checkpoint"
                    )
                shape = tuple(stored.get_shape())
                want = expected[name].shape
                if shape != want:
                    raise CheckpointError(
                        f"tensor {name} in {file.name} has shape {list(shape)}, "
                        f"expected {list(want)}"
                    )
    target = torch.device(device)
    for file, names in by_file.items():
        with _open(file, str(target)) as f:
            for name in names:
                tensor = f.get_tensor(name).to(dtype=target_dtype)
                _set_parameter(model, expected[name], tensor)
    model.rotary.cos_sin_table(target)  # built once here, not in the first step
    model.eos_token_ids = eos_token_ids(Path(path), config)
    return model


# The safetensors dtypes a weight may be stored in (cast to the model's dtype on load).
_FLOAT_DTYPES = frozenset({"F32", "BF16", "F16"})


def _open(file: Path, device: str) -> Any:  # safetensors' safe_open has no type hints
    try:
        return safe_open(str(file), framework="pt", device=device)
    except Exception as e:  # safetensors raises its own SafetensorError for corrupt headers
        raise CheckpointError(f"cannot read {file}: {e}") from e


def _set_parameter(model: nn.Module, target: WeightTarget, tensor: torch.Tensor) -> None:
    module_name, _, attr = target.parameter.rpartition(".")
    module = model.get_submodule(module_name)
    if target.rows is None and target.expert is None:
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
        return
    param = getattr(module, attr)
    if param.is_meta:  # the first part of a merged parameter allocates all of it
        param = nn.Parameter(
            torch.empty(param.shape, dtype=tensor.dtype, device=tensor.device), requires_grad=False
        )
        setattr(module, attr, param)
    target_view(param, target).copy_(tensor)


GENERATION_CONFIG = "generation_config.json"


def eos_token_ids(model_dir: Path, config: Qwen3Config) -> frozenset[int]:
    """End-of-sequence ids: generation_config.json's `eos_token_id`, else config.json's.

    Qwen3 chat checkpoints list two there (<|im_end|> and <|endoftext|>) but only one in
    config.json, so generation_config.json wins when present.
    """
    path = model_dir / GENERATION_CONFIG
    ids: object = config.eos_token_id
    if path.exists():
        try:
            generation = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise StartupError(f"{path} is not valid JSON: {e}") from None
        if isinstance(generation, dict) and generation.get("eos_token_id") is not None:
            ids = generation["eos_token_id"]
    if ids is None:
        return frozenset()
    listed = [ids] if isinstance(ids, int) else ids
    if not isinstance(listed, list) or not all(
        isinstance(i, int) and 0 <= i < config.vocab_size for i in listed
    ):
        raise StartupError(f"{model_dir}: eos_token_id {ids!r} is not a list of ids in the vocab")
    return frozenset(listed)
