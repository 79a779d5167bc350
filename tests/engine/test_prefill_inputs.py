"""A prefill graph's inputs (prefill_inputs.py) on the CPU: what the static buffers hold, and that
the padded step they make (more tokens, more sequence rows, all padding on the null block)
computes each chunk's last-token logits as the eager step of the chunks alone does. The
capture and replay need CUDA: tests/engine/test_prefill_graphs_gpu.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.step.prefill_graphs import prefill_token_sizes
from mili.engine.step.prefill_inputs import PrefillInputs
from mili.engine.step.runner import ModelRunner

BLOCK_SIZE = 4


def test_inputs_pad_tokens_and_sequences_onto_the_null_block() -> None:
    null = 9
    inputs = PrefillInputs(16, 4, 5, BLOCK_SIZE, null, torch.device("cpu"))
    # a fresh prompt of 3 tokens, and a chunk at positions 6..9 of a longer one
    inputs.fill([[11, 12, 13], [21, 22, 23, 24]], [[2], [5, 6, 7]], [0, 6], 12)
    batch = inputs.batch(12)
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 22, 23, 24] + [0] * 5
    assert batch.positions.tolist() == [0, 1, 2, 6, 7, 8, 9] + [0] * 5
    # slots: block * 4 + position % 4; padding in the null block's slot 0
    assert batch.slot_mapping.tolist() == [8, 9, 10, 26, 27, 28, 29] + [36] * 5
    assert batch.cu_seqlens.tolist() == [0, 3, 7, 7, 7]  # padded sequences: no tokens
    assert batch.start_positions.tolist() == [0, 6, 0, 0]
    assert batch.block_tables.tolist() == [
        [2, null, null, null, null],
        [5, 6, 7, null, null],
        [null] * 5,
        [null] * 5,
    ]
    # a smaller step next: nothing of the last one is left in what it reads
    inputs.fill([[31]], [[3]], [0], 4)
    batch = inputs.batch(4)
    assert batch.input_ids.tolist() == [31, 0, 0, 0]
    assert batch.cu_seqlens.tolist() == [0, 1, 1, 1, 1]
    assert batch.block_tables.tolist()[1] == [null] * 5
    with pytest.raises(ValueError, match="at most 4 chunks and 16 tokens"):
        inputs.fill([[1]] * 5, [[0]] * 5, [0] * 5, 8)
    with pytest.raises(ValueError, match="padded to 2"):
        inputs.fill([[1, 2, 3]], [[0]], [0], 2)
    with pytest.raises(ValueError, match="wider than 5 blocks"):
        inputs.fill([[1]], [[0] * 6], [0], 4)


def test_token_sizes_pad_by_at_most_half_past_256() -> None:
    assert prefill_token_sizes(2048) == (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
    assert prefill_token_sizes(1000) == (16, 32, 64, 128, 256, 384, 512, 768, 1000)
    assert prefill_token_sizes(8) == (8,)
    sizes = prefill_token_sizes(8192)
    assert sizes[-1] == 8192 and list(sizes) == sorted(set(sizes))
    assert all(b <= 2 * a for a, b in itertools.pairwise(sizes))


@pytest.mark.parametrize("model_name", ["untied_gqa4", "tied_gqa2", "bias_gqa2"])
def test_the_padded_step_computes_the_chunks_last_logits(
    engine_models: dict[str, Qwen3ForCausalLM], model_name: str
) -> None:
    """Chunks (one continuing a cached prefix) run padded to 32 tokens and 6 sequence rows in
    one cache, alone and eagerly in another: the same last-token logits, and the same K/V in
    their blocks; the padding wrote only the null block."""
    model = engine_models[model_name]
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (6,), generator=g).tolist()
    chunks = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 9, 1)]
    tables = [[0, 1], [2, 3, 4, 5], [6]]
    starts = [0, len(prefix), 0]
    runners = [ModelRunner.create(model, 16, BLOCK_SIZE) for _ in range(2)]
    for runner in runners:  # the second chunk continues a prompt whose first 6 are cached
        runner.prefill([prefix], [tables[1]], [0])
    padded, eager = runners
    null = padded.null_block_id
    inputs = PrefillInputs(32, 6, 8, BLOCK_SIZE, null, torch.device("cpu"))
    inputs.fill(chunks, tables, starts, 32)
    got = model.prefill(inputs.batch(32), padded.kv_cache)[: len(chunks)]
    expected = eager.prefill(chunks, tables, starts)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    used = [b for t in tables for b in t]
    for layer in range(model.config.num_hidden_layers):
        for cache in ("k", "v"):
            a = getattr(padded.kv_cache, cache)[layer]
            b = getattr(eager.kv_cache, cache)[layer]
            torch.testing.assert_close(a[used], b[used], rtol=1e-5, atol=1e-5)
            others = [i for i in range(a.shape[0]) if i not in used and i != null]
            assert not a[others].any()  # padding touched no block but the null one
