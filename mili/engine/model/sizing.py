"""How many weights a config has, counted from its shapes alone (pure: before anything loads).

A start-up refuses a model whose weights cannot fit on its device before reading a byte of
them (mili/engine/kv_memory.py's `check_weights_fit`): a Qwen3-235B-A22B checkpoint on one
80 GB GPU fails in a second with the number it needs, not after minutes of loading.
"""

from __future__ import annotations

from mili.engine.model.config import Qwen3Config


def num_parameters(config: Qwen3Config) -> int:
    """Every parameter of the model `config` builds (the tests check it against the model)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden + 2 * head_dim  # q/k/v, o, q/k norms
    if config.attention_bias:
        attention += q + 2 * kv + hidden
    dense_mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    sparse_mlp = config.num_experts * (hidden + 3 * hidden * config.moe_intermediate_size)
    total = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2) + hidden
    for layer in range(config.num_hidden_layers):
        mlp = sparse_mlp if config.is_sparse_layer(layer) else dense_mlp
        total += attention + mlp + 2 * hidden  # + input and post-attention norms
    return total


def num_active_parameters(config: Qwen3Config) -> int:
    """Parameters less the experts a token does not pick (the "A3B" of Qwen3-30B-A3B, counted
    as Qwen's model cards count it: embeddings and head included)."""
    idle = config.num_experts - config.num_experts_per_tok
    per_layer = idle * 3 * config.hidden_size * config.moe_intermediate_size
    return num_parameters(config) - config.num_sparse_layers * per_layer


def weight_bytes(config: Qwen3Config, itemsize: int) -> int:
    """Bytes of the weights in a dtype of `itemsize` bytes per element."""
    return num_parameters(config) * itemsize
