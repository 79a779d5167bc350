"""The random-weight models the benchmarks share: mili.engine.model.config's Qwen3 presets, plus
`tiny` for checks of the scripts themselves (seconds on any CPU, same code paths).

The presets include the mixture-of-experts `qwen3-30b-a3b` (48 layers, hidden 2048, 32/4 heads
of 128, 128 experts of 768 with 8 active) and `qwen3-235b-a22b` (94 layers, hidden 4096, 64/4
heads, 128 experts of 1536, 8 active), shapes from the published config.json of
Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (tests/engine/test_moe.py reads the former back
into the preset). Their checkpoints are 61 GB and 470 GB in bf16: benchmarks of them make
random weights in memory (benchmarks/moe.py: one layer) rather than write one here.

Each is written once as a checkpoint into the cache directory the benchmarks share
(mili.engine.checkpoint.cached_random_checkpoint: `<name>-<dtype>-seed0`), then reused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mili.engine.model.checkpoint import cached_random_checkpoint
from mili.engine.model.config import PRESETS, Qwen3Config
from mili.engine.model.loader import load_config

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
CHOICES = ["tiny", *PRESETS]


def preset_config(name: str) -> Qwen3Config:
    return TINY if name == "tiny" else PRESETS[name]


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
