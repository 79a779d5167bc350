"""KV layouts: the one dtype list, torch-free block sizes, and refusing a mismatched pair."""

from __future__ import annotations

import pytest

from mili.engine.kv.kv_layout import DTYPES, KVLayout
from mili.engine.model.config import Qwen3Config
from mili.engine.model.kv_cache import TORCH_DTYPES, KVCache
from mili.errors import FailedPrecondition
from mili.rpc import kv_layout

LAYOUT = KVLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=32, dtype="bfloat16")
CONFIG = Qwen3Config(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def test_layout_mismatch_names_both_layouts() -> None:
    prefill = kv_layout.layout_to_proto(LAYOUT, "abc")
    decode = kv_layout.layout_to_proto(LAYOUT._replace(block_size=32), "abc")
    kv_layout.check_compatible(prefill, prefill, local_name="a", remote_name="b")
    with pytest.raises(FailedPrecondition) as err:
        kv_layout.check_compatible(decode, prefill, local_name="decode", remote_name="prefill")
    message = str(err.value)
    assert "decode has [block_size=32" in message and "prefill has [block_size=16" in message


def test_the_torch_table_covers_exactly_the_dtype_list() -> None:
    assert tuple(TORCH_DTYPES) == DTYPES
    for name, dtype in TORCH_DTYPES.items():
        assert str(dtype) == f"torch.{name}"


@pytest.mark.parametrize("name", DTYPES)
def test_block_bytes_without_torch_equal_a_cache_block(name: str) -> None:
    cache = KVCache(CONFIG, num_blocks=3, block_size=4, dtype=TORCH_DTYPES[name])
    layout = kv_layout.layout_to_proto(cache.layout, "fp")
    k = cache.gather_layers(0, 1, cache.block_index([1]))[0, 0]  # [1, block_size, heads, D]
    assert kv_layout.block_bytes(layout) == k.numel() * k.element_size()


def test_block_bytes_refuse_an_unknown_dtype() -> None:
    layout = kv_layout.layout_to_proto(LAYOUT._replace(dtype="float64"), "fp")
    with pytest.raises(FailedPrecondition, match="unsupported KV dtype 'float64'"):
        kv_layout.block_bytes(layout)
