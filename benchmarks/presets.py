"""The random-weight models the benchmarks share: mili.engine.model.config's Qwen3 presets, plus
`tiny` for checks of the scripts themselves (seconds on any CPU, same code paths).

The presets include the mixture-of-experts `qwen3-30b-a3b` (48 layers, hidden 2048, 32/4 heads
of 128, 128 experts of 768 with 8 active) and `qwen3-235b-a22b` (94 layers, hidden 4096, 64/4
heads, 128 experts of 1536, 8 active), shapes from the published config.json of
Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (tests/engine/test_moe.py reads the former back
into the preset). Their checkpoints are 61 GB and 470 GB in bf16: benchmarks of them make
random weights in memory rather than write one here (benchmarks/moe.py: one layer;
`random_model`: the whole model, or its first layers, straight on the device).

Each is written once as a checkpoint into the cache directory the benchmarks share
(mili.engine.checkpoint.cached_random_checkpoint: `<name>-<dtype>-seed0`), then reused.
`tiny-moe` is `tiny` with every MLP sparse (8 experts of 32, 2 active): the MoE paths of the
scripts, checked on any CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
from pathlib import Path

import torch

from mili.engine.model.checkpoint import cached_random_checkpoint
from mili.engine.model.config import PRESETS, Qwen3Config
from mili.engine.model.loader import load_config
from mili.engine.model.qwen3 import Qwen3ForCausalLM

DEFAULT_CACHE = Path.home() / ".cache" / "mili" / "bench"
# 2 layers, heads 64 wide (the Mojo kernels' smallest head_dim, so `--attention mojo` runs), GQA
# 2:1, the demo tokenizer's (padded) vocabulary: `mili serve` pairs the two, and decode checks
# that the tokenizer's end-of-sequence ids are in the model's vocabulary.
TINY = Qwen3Config(
    vocab_size=896,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
)
# Expert widths multiples of 8: what torch._grouped_mm's CUDA kernel takes.
TINY_MOE = dataclasses.replace(
    TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
)
SMALL = {"tiny": TINY, "tiny-moe": TINY_MOE}
CHOICES = [*SMALL, *PRESETS]


def preset_config(name: str) -> Qwen3Config:
    return SMALL[name] if name in SMALL else PRESETS[name]


def random_model(
    config: Qwen3Config,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    std: float = 0.02,
) -> Qwen3ForCausalLM:
    """`config`'s model with random weights made on `device` in `dtype`, no checkpoint: built on
    `meta`, then each parameter allocated and filled where it will live (the largest transient
    is that parameter, never the model on the host). The checkpoints' rule (checkpoint.py):
    N(0, std), norm weights 1 + N(0, std); each parameter's generator seeded from (seed, its
    name), so a run is repeatable on one device (not equal to the checkpoint's bytes: another
    generator). Routing by a random router over random activations spreads the tokens nearly
    evenly over the experts: a balanced load, as a benchmark of expert compute wants."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    for name, param in list(model.named_parameters()):
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        generator = torch.Generator(device).manual_seed(int.from_bytes(digest[:8], "little"))
        tensor = torch.empty(param.shape, dtype=dtype, device=device)
        tensor.normal_(0.0, std, generator=generator)
        if name.endswith("norm.weight"):
            tensor.add_(1.0)
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(tensor, False))
    if any(b.is_meta for b in model.buffers()):
        raise RuntimeError("a buffer of the model is still on meta: random_model misses it")
    model.rotary.cos_sin_table(device)  # built once here, as the loader does
    return model


def preset_checkpoint(name: str, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The bf16 checkpoint of preset `name` (seed 0) in `cache_dir`, written on first use.

    The cache is keyed by name only: one written by an older definition of the preset (`tiny`
    had heads 32 wide, which the Mojo kernels refuse) is an error here, not a puzzle later."""
    config = preset_config(name)
    path = cached_random_checkpoint(config, name, cache_dir)
    if load_config(path) != config:
        raise RuntimeError(f"{path} holds another {name!r} than benchmarks/presets.py's: delete it")
    return path


def main() -> None:
    """Write one preset's checkpoint ahead of its users (the GPU check does, meanwhile)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("preset", choices=CHOICES)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    print(preset_checkpoint(args.preset, args.cache_dir))


if __name__ == "__main__":
    main()
