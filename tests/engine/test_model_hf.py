"""Our Qwen3 over the paged KV cache vs HF transformers' Qwen3ForCausalLM, same files on disk."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from mili.engine.model.config import PRESETS
from mili.engine.model.kv_cache import (
    KVCache,
    bytes_per_block,
    slots_for_range,
)
from mili.engine.model.loader import load_model
from mili.engine.model.qwen3 import DecodeBatch, PrefillBatch, Qwen3ForCausalLM
from mili.engine.model.rope import RotaryEmbedding

TOL = 1e-4  # fp32, max abs difference of logits
HF_CONFIGS = ["tied_gqa2", "untied_gqa4"]


def random_ids(n: int, vocab_size: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=g).tolist()


def hf_logits(hf: Any, token_ids: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([list(token_ids)])).logits[0].float()  # [n, vocab]


class Runner:
    """Drives our model the way a service does: block tables of scattered ids, one cache."""

    def __init__(self, model: Qwen3ForCausalLM, block_size: int, num_blocks: int = 64) -> None:
        self.model = model
        self.block_size = block_size
        self.cache = KVCache(model.config, num_blocks, block_size)
        # Hand out ids in a scrambled order so no sequence gets contiguous blocks.
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
        self.free_ids: list[int] = order.tolist()

    def table(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        taken, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        return taken

    def grow(self, table: list[int], num_tokens: int) -> None:
        table.extend(self.table(num_tokens - len(table) * self.block_size))

    def prefill(
        self,
        chunks: Sequence[Sequence[int]],
        tables: Sequence[list[int]],
        starts: Sequence[int] | None = None,
        *,
        all_logits: bool = True,
    ) -> torch.Tensor:
        batch = PrefillBatch.build(chunks, tables, self.block_size, start_positions=starts)
        return self.model.prefill(batch, self.cache, all_logits=all_logits)

    def decode(
        self, token_ids: Sequence[int], positions: Sequence[int], tables: Sequence[list[int]]
    ) -> torch.Tensor:
        for table, pos in zip(tables, positions, strict=True):
            self.grow(table, pos + 1)
        batch = DecodeBatch.build(token_ids, positions, tables, self.block_size)
        return self.model.decode(batch, self.cache)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", HF_CONFIGS)
@pytest.mark.parametrize("length", [1, 15, 16, 17, 100])
def test_prefill_logits_match_hf(
    name: str, length: int, engine_models: dict[str, Qwen3ForCausalLM], hf_models: dict[str, Any]
) -> None:
    model = engine_models[name]
    prompt = random_ids(length, model.config.vocab_size, seed=length)
    ref = hf_logits(hf_models[name], prompt)
    runner = Runner(model, block_size=16)
    table = runner.table(length)
    logits = runner.prefill([prompt], [table])
    assert logits.dtype == torch.float32
    assert max_diff(logits, ref) < TOL
    last = Runner(model, block_size=16).prefill([prompt], [table], all_logits=False)
    assert max_diff(last, ref[-1:]) < TOL


@pytest.mark.parametrize("name", [*HF_CONFIGS, "yarn"])
def test_decode_32_steps_match_hf(
    name: str, engine_models: dict[str, Qwen3ForCausalLM], hf_models: dict[str, Any]
) -> None:
    """Three sequences decode together through the paged cache, teacher-forced."""
    model = engine_models[name]
    vocab = model.config.vocab_size
    prompt_lens, num_steps = [1, 10, 17], 32
    full = [random_ids(n + num_steps, vocab, seed=100 + n) for n in prompt_lens]
    refs = [hf_logits(hf_models[name], ids) for ids in full]
    runner = Runner(model, block_size=16)
    tables = [runner.table(n) for n in prompt_lens]
    last = runner.prefill(
        [ids[:n] for ids, n in zip(full, prompt_lens, strict=True)], tables, all_logits=False
    )
    for i, n in enumerate(prompt_lens):
        assert max_diff(last[i], refs[i][n - 1]) < TOL
    for step in range(num_steps):
        positions = [n + step for n in prompt_lens]
        tokens = [ids[p] for ids, p in zip(full, positions, strict=True)]
        logits = runner.decode(tokens, positions, tables)
        assert logits.shape == (3, vocab) and logits.dtype == torch.float32
        for i, p in enumerate(positions):
            assert max_diff(logits[i], refs[i][p]) < TOL, (step, i)


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_mixed_batch_equals_each_alone(
    name: str, engine_models: dict[str, Qwen3ForCausalLM]
) -> None:
    model = engine_models[name]
    lengths = [1, 17, 5, 33, 16]
    prompts = [random_ids(n, model.config.vocab_size, seed=200 + n) for n in lengths]
    runner = Runner(model, block_size=16)
    tables = [runner.table(n) for n in lengths]
    batched = runner.prefill(prompts, tables)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    batched_steps = [runner.decode([7] * 5, [n + s for n in lengths], tables) for s in range(4)]
    for i, prompt in enumerate(prompts):
        alone = Runner(model, block_size=16)
        table = alone.table(len(prompt))
        assert max_diff(batched[bounds[i] : bounds[i + 1]], alone.prefill([prompt], [table])) < 1e-5
        for s in range(4):
            step = alone.decode([7], [len(prompt) + s], [table])
            assert max_diff(batched_steps[s][i : i + 1], step) < 1e-5


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_block_sizes_give_same_results(
    name: str, engine_models: dict[str, Qwen3ForCausalLM], hf_models: dict[str, Any]
) -> None:
    model = engine_models[name]
    full = random_ids(40 + 8, model.config.vocab_size, seed=300)
    ref = hf_logits(hf_models[name], full)
    results = {}
    for block_size in (1, 16, 32):
        runner = Runner(model, block_size=block_size, num_blocks=64)
        table = runner.table(40)
        logits = [runner.prefill([full[:40]], [table])]
        logits += [runner.decode([full[p]], [p], [table]) for p in range(40, 48)]
        results[block_size] = torch.cat(logits)
        assert max_diff(results[block_size], ref) < TOL
    assert max_diff(results[1], results[16]) < 1e-5
    assert max_diff(results[16], results[32]) < 1e-5


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_chunked_prefill_matches_hf(
    name: str, engine_models: dict[str, Qwen3ForCausalLM], hf_models: dict[str, Any]
) -> None:
    """Chunks start mid-block and attend to the cached prefix (start_positions > 0)."""
    model = engine_models[name]
    prompt = random_ids(50, model.config.vocab_size, seed=400)
    other = random_ids(9, model.config.vocab_size, seed=401)
    ref = hf_logits(hf_models[name], prompt)
    ref_other = hf_logits(hf_models[name], other)
    runner = Runner(model, block_size=16)
    table: list[int] = []
    other_table = runner.table(len(other))
    pieces, start = [], 0
    for size in (16, 1, 20, 13):
        runner.grow(table, start + size)
        chunk = prompt[start : start + size]
        if start == 16:  # one round shares its batch with a fresh prompt
            logits = runner.prefill([chunk, other], [table, other_table], [start, 0])
            assert max_diff(logits[size:], ref_other) < TOL
            logits = logits[:size]
        else:
            logits = runner.prefill([chunk], [table], [start])
        pieces.append(logits)
        start += size
    assert max_diff(torch.cat(pieces), ref) < TOL


def test_yarn_matches_hf_and_differs_from_plain_rope(
    engine_models: dict[str, Qwen3ForCausalLM], hf_models: dict[str, Any]
) -> None:
    model = engine_models["yarn"]
    assert hf_models["yarn"].model.rotary_emb.attention_scaling > 1  # HF did apply YaRN
    assert model.rotary.attention_scaling == hf_models["yarn"].model.rotary_emb.attention_scaling
    torch.testing.assert_close(
        model.rotary.inv_freq, hf_models["yarn"].model.rotary_emb.inv_freq, rtol=0, atol=0
    )
    prompt = random_ids(100, model.config.vocab_size, seed=500)
    ref = hf_logits(hf_models["yarn"], prompt)
    runner = Runner(model, block_size=16)
    table = runner.table(100)
    logits = runner.prefill([prompt], [table])
    assert max_diff(logits, ref) < TOL
    assert len(prompt) > model.config.max_position_embeddings  # YaRN's context serves it
    context = model.config.max_context_tokens
    plain = RotaryEmbedding(
        dataclasses.replace(model.config, rope_scaling=None, max_position_embeddings=context)
    )
    yarn_rotary, model.rotary = model.rotary, plain
    try:
        plain_logits = Runner(model, block_size=16).prefill([prompt], [table])
    finally:
        model.rotary = yarn_rotary
    assert max_diff(plain_logits, ref) > 1e-2  # the test above would catch ignoring YaRN


def test_gather_scatter_moves_a_request_between_caches(
    engine_models: dict[str, Qwen3ForCausalLM],
) -> None:
    """What the KV transfer does: prefill on one cache, ship whole blocks, decode on another."""
    model = engine_models["untied_gqa4"]
    prompt = random_ids(37, model.config.vocab_size, seed=600)
    src = Runner(model, block_size=16, num_blocks=8)
    src_table = [3, 0, 5]
    src.prefill([prompt], [src_table], all_logits=False)
    dst = Runner(model, block_size=16, num_blocks=16)
    dst_table = [14, 2, 9]
    blocks = src.cache.gather_layers(0, src.cache.num_layers, src.cache.block_index(src_table))
    assert blocks.shape == (model.config.num_hidden_layers, 2, 3, 16, 2, 16)
    assert blocks.is_contiguous()
    for layer in range(model.config.num_hidden_layers):
        dst.cache.scatter_blocks(layer, dst_table, blocks[layer, 0], blocks[layer, 1])
    expected = src.decode([11], [37], [src_table])
    assert torch.equal(dst.decode([11], [37], [dst_table]), expected)


def test_slots_and_budget() -> None:
    block_table = [7, 2, 9]
    assert slots_for_range(block_table, 0, 10, 4) == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]

    config = PRESETS["qwen3-0.6b"]  # 28 layers x 8 kv heads x 128: 112 KiB/token in bf16
    assert bytes_per_block(config, 16, torch.bfloat16) == 16 * 112 * 1024
    assert bytes_per_block(config, 16, torch.float32) == 32 * 112 * 1024
    cache = KVCache(dataclasses.replace(config, num_hidden_layers=2), 3, 16, dtype=torch.bfloat16)
    assert cache.k[0].shape == (3, 16, 8, 128)
    assert cache.layout == (2, 16, 8, 128, "bfloat16")
    with pytest.raises(IndexError, match="block ids"):
        cache.block_index([3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_precision_tracks_cpu_fp32(
    dtype: torch.dtype, checkpoint_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    """The same code path on CUDA in bf16/fp16: prefill + decode close to HF fp32 on CPU."""
    model = load_model(checkpoint_dirs["untied_gqa4"], device="cuda", dtype=dtype)
    assert model.device.type == "cuda" and model.dtype == dtype
    full = random_ids(40 + 8, model.config.vocab_size, seed=1000)
    ref = hf_logits(hf_models["untied_gqa4"], full)
    cache = KVCache(model.config, 8, 16, dtype=dtype, device="cuda")
    table = [5, 1, 6, 2]
    batch = PrefillBatch.build([full[:40]], [table], 16, device="cuda")
    logits = [model.prefill(batch, cache, all_logits=True)]
    for p in range(40, 48):
        step = DecodeBatch.build([full[p]], [p], [table], 16, device="cuda")
        logits.append(model.decode(step, cache))
    got = torch.cat(logits).cpu()
    assert got.dtype == torch.float32
    assert max_diff(got, ref) < 0.05 * ref.abs().max().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.85
