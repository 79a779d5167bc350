"""Qwen3 model configuration: the subset of HF `config.json` our engine reads, plus named presets.

The field names are HF's, so `Qwen3Config.from_hf_dict(json.load(f))` reads a real checkpoint and
`to_hf_dict()` writes one that `transformers.Qwen3ForCausalLM` loads unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Fields a config.json must carry for us to build the model; everything else has a default.
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


class ConfigError(ValueError):
    """config.json is missing a field or holds an inconsistent value (the message names it)."""


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    # Qwen3 decouples head_dim from hidden_size / num_attention_heads (0.6B: 1024 hidden, 16 heads,
    # head_dim 128), so it is a field of its own, never derived.
    head_dim: int = 128
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # HF's rope_scaling dict, e.g. {"rope_type": "yarn", "factor": 4.0,
    # "original_max_position_embeddings": 32768}; None for plain RoPE.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=True)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        for name in (*_REQUIRED, "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(
                    f"config field {name!r} must be a positive integer, got {value!r}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"config field 'hidden_act' must be 'silu', got {self.hidden_act!r}")

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> Qwen3Config:
        """Build from a parsed HF config.json; raises ConfigError naming a missing field."""
        model_type = data.get("model_type")
        if model_type is not None and model_type != "qwen3":
            raise ConfigError(f"config field 'model_type' must be 'qwen3', got {model_type!r}")
        missing = [name for name in _REQUIRED if name not in data]
        if missing:
            raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names and v is not None}
        if "head_dim" not in data:
            kwargs["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        if "dtype" in data and "torch_dtype" not in data:  # transformers>=4.56 writes "dtype"
            kwargs["torch_dtype"] = data["dtype"]
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: Path) -> Qwen3Config:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(data)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json HF transformers writes for Qwen3ForCausalLM."""
        data = dataclasses.asdict(self)
        data.update(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            attention_dropout=0.0,
            initializer_range=0.02,
            use_cache=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=self.num_hidden_layers,
        )
        return data


def _preset(hidden: int, inter: int, layers: int, heads: int, tie: bool) -> Qwen3Config:
    # All released dense Qwen3 models share vocab, kv heads, head_dim, RoPE base and context.
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=tie,
        bos_token_id=151643,
        eos_token_id=151645,
    )


# Shapes of the released dense Qwen3 checkpoints, for random-weight checkpoints of real sizes.
PRESETS: dict[str, Qwen3Config] = {
    "qwen3-0.6b": _preset(1024, 3072, 28, 16, tie=True),
    "qwen3-1.7b": _preset(2048, 6144, 28, 16, tie=True),
    "qwen3-4b": _preset(2560, 9728, 36, 32, tie=True),
    "qwen3-8b": _preset(4096, 12288, 36, 32, tie=False),
    "qwen3-14b": _preset(5120, 17408, 40, 40, tie=False),
    "qwen3-32b": _preset(5120, 25600, 64, 64, tie=False),
}
