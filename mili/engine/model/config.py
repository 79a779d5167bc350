"""Qwen3 model configuration: the subset of HF `config.json` our engine reads, plus named presets.

The field names are HF's, so `Qwen3Config.from_hf_dict(json.load(f))` reads a real checkpoint and
`to_hf_dict()` writes one that `transformers.Qwen3ForCausalLM` (or, with experts,
`Qwen3MoeForCausalLM`) loads unchanged.

One config type covers both families: Qwen3-MoE changes only the MLP of some layers (a router
and `num_experts` experts of `moe_intermediate_size`), so `num_experts == 0` is the dense model
and every other field means the same in both. Which layers are sparse is HF's rule
(`is_sparse_layer`). Both spellings of the checkpoints in the wild are read: the published
`config.json` (`num_experts`, `rope_theta`, `torch_dtype`) and what transformers 5 writes
(`num_local_experts`, `rope_parameters`, `dtype`).
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
    # Mixture of experts (model_type "qwen3_moe"); num_experts 0 is the dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (dense layers)

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
        if self.num_experts:
            self._check_moe()

    def _check_moe(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(
                    f"config field {name!r} must be a positive integer, got {value!r}"
                )
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                f"({self.num_experts})"
            )
        if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step <= 0:
            raise ConfigError(
                "config field 'decoder_sparse_step' must be a positive integer, "
                f"got {self.decoder_sparse_step!r}"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(f"mlp_only_layers {bad} are not layers of this model")

    @property
    def is_moe(self) -> bool:
        """Whether some layers route tokens to experts (Qwen3-MoE)."""
        return self.num_experts > 0

    @property
    def max_context_tokens(self) -> int:
        """Positions the model serves: `max_position_embeddings`, or with YaRN the context it
        stretches the pre-trained one to, original_max_position_embeddings x factor. Qwen3's
        recipe keeps max_position_embeddings at 40960 beside {"factor": 4,
        "original_max_position_embeddings": 32768}: 131072 tokens, as vLLM derives."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) != "yarn":
            return self.max_position_embeddings
        # rope.py's reading: without an original length, the pre-trained context is
        # max_position_embeddings; without a factor, the two lengths' ratio is the factor.
        original = scaling.get("original_max_position_embeddings") or self.max_position_embeddings
        factor = scaling.get("factor")
        if factor is None:
            return self.max_position_embeddings
        return max(self.max_position_embeddings, int(original * factor))

    @property
    def architecture(self) -> str:
        """HF's class name for this config: what config.json's `architectures` holds."""
        return "Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) is a mixture of experts; HF's rule, verbatim."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.is_sparse_layer(i) for i in range(self.num_hidden_layers))

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> Qwen3Config:
        """Build from a parsed HF config.json; raises ConfigError naming a missing field."""
        model_type = data.get("model_type")
        if model_type is not None and model_type not in _MODEL_TYPES:
            raise ConfigError(
                f"config field 'model_type' must be one of {list(_MODEL_TYPES)}, got {model_type!r}"
            )
        is_moe = model_type == "qwen3_moe"
        quantization = data.get("quantization_config")
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            raise ConfigError(
                f"quantized checkpoints are not supported (config.json quantization_config, "
                f"quant_method {method!r}): their weights would load without their scales; "
                "serve the bfloat16 checkpoint"
            )
        if data.get("use_sliding_window"):
            raise ConfigError(
                "sliding-window attention (config.json use_sliding_window: true) is not "
                "supported: every layer would attend to the whole context"
            )
        data = dict(data)
        if "num_local_experts" in data and "num_experts" not in data:  # transformers 5
            data["num_experts"] = data["num_local_experts"]
        required = (*_REQUIRED, *_REQUIRED_MOE) if is_moe else _REQUIRED
        missing = [name for name in required if name not in data]
        if missing:
            raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}")
        names = {f.name for f in dataclasses.fields(cls)}
        if not is_moe:  # a dense config's stray MoE keys (HF defaults) mean nothing
            names -= _MOE_FIELDS
        kwargs = {k: v for k, v in data.items() if k in names and v is not None}
        # transformers' rules where these are left out or null: no kv heads given is one per
        # attention head (multi-head attention); the dense config's head_dim defaults to 128,
        # the MoE config has no such field and derives it.
        if data.get("num_key_value_heads", 0) is None:
            kwargs["num_key_value_heads"] = data["num_attention_heads"]
        if data.get("head_dim") is None and (is_moe or "head_dim" in data):
            kwargs["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        if "dtype" in data and "torch_dtype" not in data:  # transformers>=4.56 writes "dtype"
            kwargs["torch_dtype"] = data["dtype"]
        kwargs.update(_rope_from_parameters(data))
        # Left out of config.json, these are what transformers' Qwen3 configs default to.
        kwargs.setdefault("rope_theta", 10_000.0)
        kwargs.setdefault("max_position_embeddings", 32_768)
        if "mlp_only_layers" in kwargs:
            kwargs["mlp_only_layers"] = tuple(kwargs["mlp_only_layers"])
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
        """The config.json HF transformers writes for Qwen3ForCausalLM (Qwen3MoeForCausalLM
        with experts: the published keys, `num_experts` and `rope_theta`)."""
        data = dataclasses.asdict(self)
        if self.is_moe:
            data["mlp_only_layers"] = list(self.mlp_only_layers)
        else:
            for name in _MOE_FIELDS:
                del data[name]
        data.update(
            architectures=[self.architecture],
            model_type="qwen3_moe" if self.is_moe else "qwen3",
            attention_dropout=0.0,
            initializer_range=0.02,
            use_cache=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=self.num_hidden_layers,
        )
        return data


_MODEL_TYPES = ("qwen3", "qwen3_moe")
_REQUIRED_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
_MOE_FIELDS = frozenset(
    (*_REQUIRED_MOE, "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
)


def _rope_from_parameters(data: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope_scaling from transformers 5's `rope_parameters` (which holds both:
    {"rope_type": "default", "rope_theta": 1e6}, or YaRN's keys beside them); the older
    top-level keys win where both are present."""
    params = data.get("rope_parameters")
    if not isinstance(params, dict):
        return {}
    out: dict[str, Any] = {}
    if "rope_theta" in params and data.get("rope_theta") is None:
        out["rope_theta"] = params["rope_theta"]
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default" and data.get("rope_scaling") is None:
        out["rope_scaling"] = scaling
    return out


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


def _moe_preset(hidden: int, inter: int, moe_inter: int, layers: int, heads: int) -> Qwen3Config:
    # The published config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B on the HF Hub:
    # 4 kv heads of 128, 128 experts with 8 active, norm_topk_prob true, every layer sparse
    # (decoder_sparse_step 1, no mlp_only_layers), untied, vocab/RoPE/context as the dense ones.
    return dataclasses.replace(
        _preset(hidden, inter, layers, heads, tie=False),
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=moe_inter,
        norm_topk_prob=True,
    )


PRESETS.update(
    {
        "qwen3-30b-a3b": _moe_preset(2048, 6144, 768, 48, 32),
        "qwen3-235b-a22b": _moe_preset(4096, 12288, 1536, 94, 64),
    }
)
