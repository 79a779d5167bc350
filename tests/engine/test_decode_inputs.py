"""The decode step's static inputs: graph batch sizes, which block-table rows are copied, and
exactly what the buffers hold after a fill (padded rows on the null block)."""

from __future__ import annotations

import pytest
import torch

from mili.engine.kv.block_table_rows import BlockTableRows
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.buckets import graph_batch_sizes, padded_batch_size
from mili.engine.step.decode_inputs import DecodeInputs
from mili.engine.step.sequence import Sequence

NULL = 99
BLOCK_SIZE = 4


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(3) == (1, 2, 4)
    assert graph_batch_sizes(8) == (1, 2, 4, 8)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_batch_sizes(256)[-3:] == (240, 248, 256) and len(graph_batch_sizes(256)) == 35
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_padded_batch_size_is_the_smallest_that_holds_the_batch() -> None:
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 63, 64)] == [
        1, 2, 4, 8, 8, 16, 24, 64, 64,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="exceeds"):
        padded_batch_size(65, sizes)


def test_block_table_rows_copies_only_changed_rows() -> None:
    rows = BlockTableRows(num_rows=4, width=3)
    a, b, c = [3, 9], [4], [5]
    assert rows.update([a, b]) == [0, 1]  # new requests
    assert rows.update([a, b]) == []  # nothing changed
    b.append(7)
    assert rows.update([a, b]) == [1]  # b grew
    assert rows.update([a, c, None]) == [1]  # c replaced b; row 2 was all null already
    assert rows.update([None, c]) == [0]  # a left: its row becomes padding
    assert rows.update([a, c, None]) == [0]
    assert rows.held(0) == [3, 9] and rows.held(1) == [5] and rows.held(2) is None
    assert rows.update([[3, 9], c]) == [0]  # an equal list of another request is copied
    with pytest.raises(ValueError, match="width"):
        rows.update([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="rows"):
        rows.update([None] * 5)


def seq(prompt_len: int, block_table: list[int], last_token: int) -> Sequence:
    s = Sequence.new(
        list(range(1, prompt_len + 1)), SamplingParams(), vocab_size=128, eos_token_ids=[]
    )
    s.block_table = block_table
    s.append(last_token)
    return s


def test_fill_writes_exact_rows_and_pads_on_the_null_block() -> None:
    inputs = DecodeInputs(max_rows=4, width=5, block_size=BLOCK_SIZE, null_block_id=NULL,
                          device=torch.device("cpu"))  # fmt: skip
    a = seq(5, [7, 2], last_token=11)  # 6 tokens: feeds token 11 at position 5 (block 2, slot 1)
    b = seq(2, [4], last_token=12)  # 3 tokens: position 2 in block 4
    width = inputs.fill([a, b], 3)
    assert width == 2  # the longest sequence reads two blocks
    batch = inputs.batch(3)
    assert batch.input_ids.tolist() == [11, 12, 0]
    assert batch.positions.tolist() == [5, 2, 0]
    assert batch.seq_lens.tolist() == [6, 3, 1] and batch.seq_lens.dtype == torch.int32
    assert batch.slot_mapping.tolist() == [2 * 4 + 1, 4 * 4 + 2, NULL * 4]
    assert batch.block_tables.tolist() == [
        [7, 2, NULL, NULL, NULL],
        [4, NULL, NULL, NULL, NULL],
        [NULL] * 5,
    ]
    assert inputs.batch(2, width).block_tables.tolist() == [[7, 2], [4, NULL]]

    # Next step: b grew a block, a did not; only b's row may be rewritten. Poison a's row on
    # the device to see that it is not copied again.
    inputs.block_tables[0, 4] = -5
    b.append(13)
    b.block_table.append(8)
    b.append(14)  # 5 tokens: feeds 14 at position 4, block 8
    inputs.fill([a, b], 2)
    assert inputs.block_tables[:2].tolist() == [[7, 2, NULL, NULL, -5], [4, 8, NULL, NULL, NULL]]
    assert inputs.batch(2).slot_mapping.tolist() == [2 * 4 + 1, 8 * 4 + 0]

    # A new request in row 0 and padding in row 1: both rows rewritten, row 2 kept as it was.
    c = seq(1, [6], last_token=15)
    inputs.fill([c], 2)
    assert inputs.block_tables[:3].tolist() == [
        [6, NULL, NULL, NULL, NULL],
        [NULL] * 5,
        [NULL] * 5,
    ]
    with pytest.raises(ValueError, match="at most 4"):
        inputs.fill([a], 5)
