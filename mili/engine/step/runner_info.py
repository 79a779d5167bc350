"""What a prefill or decode instance reports about its model runner (Info, start-up logs)."""

from __future__ import annotations

from mili.engine.kv.kv_layout import KVLayout
from mili.engine.model.kv_cache import dtype_name
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.step.runner import ModelRunner


class RunnerInfo:
    """What a prefill or decode instance reports about its `runner` (Info, start-up logs)."""

    runner: ModelRunner

    @property
    def model(self) -> Qwen3ForCausalLM:
        return self.runner.model

    @property
    def dtype(self) -> str:
        return dtype_name(self.model.dtype)

    @property
    def device(self) -> str:
        return str(self.model.device)

    @property
    def attention_backend(self) -> str:
        return self.model.attention.name

    @property
    def fused_ops(self) -> str:
        return self.model.fused_ops.name

    @property
    def vocab_size(self) -> int:
        """The tokenizer's number of token ids: the ids accepted and sampled (the model's
        embedding table may have more rows)."""
        return self.runner.vocab_size

    @property
    def layout(self) -> KVLayout:
        return self.runner.kv_cache.layout

    @property
    def architecture(self) -> str:
        """HF's class name: "Qwen3ForCausalLM" or "Qwen3MoeForCausalLM"."""
        return self.model.config.architecture

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (0: dense)."""
        return self.model.config.num_experts

    @property
    def num_active_experts(self) -> int:
        """Experts each token is routed to (0: dense)."""
        return self.model.config.num_experts_per_tok if self.model.config.is_moe else 0
