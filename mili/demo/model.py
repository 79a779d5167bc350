"""The embedded demo model: a small Qwen3 checkpoint MILI builds offline, deterministically.

It has the exact Qwen3 architecture (q/k norm, GQA, head_dim independent of hidden/heads, tied
embeddings) with random weights, and a byte-level BPE tokenizer trained on `corpus.txt`. Its
output is gibberish, but every code path — loading, templating, prefill, KV transfer, decode —
runs as it would on a real checkpoint. It is the default model wherever no `--model DIR` is
given, built once into a cache directory keyed by a hash of everything that shapes it.

`build_demo_model(dir, moe=True)` (`mili demo-model DIR --moe`) writes its Qwen3-MoE sibling:
the same attention and tokenizer, 8 experts with 2 active in layers 1-3 and a dense layer 0
(`mlp_only_layers`), in the published layout: one tensor per expert and projection, sharded
with a `model.safetensors.index.json`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from mili.cache import cache_root
from mili.demo import tokenizer as demo_tokenizer
from mili.engine.model import checkpoint
from mili.engine.model.config import Qwen3Config

_LOG = logging.getLogger("mili.demo")
SEED = 20261121
MAX_POSITION_EMBEDDINGS = 4096
MOE_SHARD_BYTES = 4 << 20  # several shards, as a published MoE checkpoint has


def demo_config(
    vocab_size: int, eos_token_id: int, pad_token_id: int, *, moe: bool = False
) -> Qwen3Config:
    """Qwen3 shapes scaled down: 8 q heads of 64 over a 256-wide residual (8*64 != 256);
    with `moe`, Qwen3-MoE's: 8 experts of 192 (2 active, renormalised), layer 0 dense."""
    config = Qwen3Config(
        vocab_size=(vocab_size + 63) // 64 * 64,  # padded like Qwen's 151936 > 151669 tokens
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        bos_token_id=pad_token_id,
        eos_token_id=eos_token_id,
    )
    if not moe:
        return config
    return dataclasses.replace(
        config,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=192,
        norm_topk_prob=True,
        mlp_only_layers=(0,),
    )


def build_demo_model(directory: Path, *, moe: bool = False) -> Path:
    """Write the demo checkpoint (with `moe`, its MoE sibling) into `directory` (created);
    same bytes every time."""
    tokenizer = demo_tokenizer.train_tokenizer()
    config = demo_config(
        tokenizer.get_vocab_size(with_added_tokens=True),
        eos_token_id=demo_tokenizer.token_id(tokenizer, demo_tokenizer.EOS_TOKEN),
        pad_token_id=demo_tokenizer.token_id(tokenizer, demo_tokenizer.PAD_TOKEN),
        moe=moe,
    )
    checkpoint.write_random_checkpoint(
        directory,
        config,
        seed=SEED,
        dtype=torch.bfloat16,
        max_shard_bytes=MOE_SHARD_BYTES if moe else None,
    )
    demo_tokenizer.write_tokenizer_files(directory, tokenizer, MAX_POSITION_EMBEDDINGS)
    return directory


def _fingerprint() -> str:
    """Hash of every input that shapes the demo checkpoint: corpus, template and the code."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    sources = [*sorted(here.glob("*.py")), demo_tokenizer.CORPUS, demo_tokenizer.CHAT_TEMPLATE]
    sources += [Path(checkpoint.__file__), Path(checkpoint.__file__).with_name("config.py")]
    for path in sources:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def default_model_dir() -> Path:
    """The demo checkpoint in the cache, built on first use (safe against concurrent builders)."""
    target = cache_root() / f"demo-model-{_fingerprint()}"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _LOG.info("building the demo model into %s", target)
    staging = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=target.parent))
    try:
        build_demo_model(staging)
        try:
            staging.rename(target)  # atomic: readers never see a half-written checkpoint
        except OSError:
            if not (target / "config.json").exists():  # not a lost race with another builder
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def describe(directory: Path) -> str:
    config = json.loads((directory / "config.json").read_text())
    experts = ""
    if config.get("num_experts"):
        experts = (
            f", {config['num_experts']} experts ({config['num_experts_per_tok']} active) of "
            f"{config['moe_intermediate_size']}"
        )
    kind = "Qwen3-MoE" if experts else "Qwen3"
    return (
        f"{kind} demo model at {directory}: {config['num_hidden_layers']} layers, hidden "
        f"{config['hidden_size']}, {config['num_attention_heads']}/"
        f"{config['num_key_value_heads']} q/kv heads of {config['head_dim']}, "
        f"vocab {config['vocab_size']}{experts}"
    )
