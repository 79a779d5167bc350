"""ModelRunner.load's start-up steps that are not the runner's own: whether decode steps may be
captured, the device memory a warm-up takes (for sizing the KV pool), and the start-up logs."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mili.engine.engine_config import EngineConfig
from mili.engine.kv.block_pool import blocks_needed
from mili.engine.kv_memory import GIB, DeviceMemory, KvPoolSize, check_weights_fit
from mili.engine.model import grouped_gemm
from mili.engine.model.config import Qwen3Config
from mili.engine.model.kv_cache import KVCache, bytes_per_block, dtype_name
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.model.sizing import num_parameters, weight_bytes
from mili.plural import plural

if TYPE_CHECKING:
    from mili.engine.step.runner import ModelRunner  # it imports this module

_LOG = logging.getLogger("mili.engine")


def check_device_fits(
    model_config: Qwen3Config, config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> None:
    """On CUDA, ValueError before loading when the weights alone exceed the device's share
    (`kv_memory.check_weights_fit`), counted from the config; the CPU is not checked."""
    if device.type != "cuda":
        return
    _, total = torch.cuda.mem_get_info(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    what = (
        f"{model_config.architecture} ({num_parameters(model_config) / 1e9:.2f} B parameters "
        f"in {dtype_name(dtype)})"
    )
    check_weights_fit(
        weight_bytes(model_config, itemsize),
        total,
        config.gpu_memory_utilization,
        what=what,
        device=str(device),
    )


def graphs_allowed(config: EngineConfig, model: Qwen3ForCausalLM) -> bool:
    """Whether steps (decode, prefill) may be captured; logs why not."""
    if config.enforce_eager:
        _LOG.info("CUDA graphs off (--enforce-eager): steps run eagerly")
        return False
    if not model.fused_ops.is_graph_safe:
        _LOG.warning(
            "CUDA graphs off: fused ops %s are not graph-safe; steps run eagerly",
            model.fused_ops.name,
        )
        return False
    widths = (model.config.hidden_size, model.config.moe_intermediate_size)
    if model.config.is_moe and not grouped_gemm.is_graph_safe(model.device, model.dtype, widths):
        _LOG.warning(
            "CUDA graphs off: the MoE experts' grouped GEMM on %s in %s needs the offsets on "
            "the host (torch._grouped_mm runs graph-safe only in bfloat16 on sm_90/sm_100, "
            "with hidden and expert widths of whole 16-byte units); "
            "steps run eagerly",
            model.device,
            model.dtype,
        )
        return False
    if not getattr(model.attention, "is_graph_safe", False):
        _LOG.warning(
            "CUDA graphs off: attention backend %s is not graph-safe (it allocates, validates "
            "or sizes its launch from values per call); steps run eagerly",
            model.attention.name,
        )
        return False
    return True


def measure_memory(
    cls: type[ModelRunner],
    model: Qwen3ForCausalLM,
    config: EngineConfig,
    max_decode_batch: int,
    max_prefill_tokens: int | None,
    *,
    full_width: bool,
) -> DeviceMemory:
    """Device memory after one warm-up at the largest batch, on a throwaway KV cache just big
    enough for it (its bytes are not counted in the peak)."""
    device = model.device
    warm_blocks = blocks_needed(max_prefill_tokens or 1, config.block_size) + 1
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache = KVCache(model.config, warm_blocks, config.block_size, dtype=model.dtype, device=device)
    cache_bytes = warm_blocks * bytes_per_block(model.config, config.block_size, model.dtype)
    runner = cls(model, cache, max_decode_batch=max_decode_batch)
    runner.warm_up(max_prefill_tokens, full_width=full_width)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - cache_bytes
    del runner, cache
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, free, peak, torch.cuda.memory_reserved(device))


def log_model(model: Qwen3ForCausalLM) -> None:
    """The architecture, and for MoE its experts and how they run (start-up log)."""
    config = model.config
    if not config.is_moe:
        _LOG.info("model: %s, %s", config.architecture, plural(config.num_hidden_layers, "layer"))
        return
    _LOG.info(
        "model: %s, %d of %d layers with %d experts of %d (%d active per token, %s); "
        "experts' grouped GEMM: the %s ops' (torch's: %s)",
        config.architecture,
        config.num_sparse_layers,
        config.num_hidden_layers,
        config.num_experts,
        config.moe_intermediate_size,
        config.num_experts_per_tok,
        "renormalised" if config.norm_topk_prob else "not renormalised",
        model.fused_ops.name,
        grouped_gemm.default_grouped_gemm(
            model.device, model.dtype, (config.hidden_size, config.moe_intermediate_size)
        ),
    )


def log_vocab(model_dir: Path, vocab_size: int | None, num_rows: int) -> None:
    if vocab_size is None:
        _LOG.warning(
            "%s has no tokenizer.json: sampling over all %d rows of the model's vocabulary",
            model_dir,
            num_rows,
        )
    elif vocab_size < num_rows:
        _LOG.info(
            "sampling the tokenizer's %d token ids; the model's %s are never drawn",
            vocab_size,
            plural(num_rows - vocab_size, "padding row"),
        )


def log_pool(size: KvPoolSize, block_size: int) -> None:
    _LOG.info(
        "KV pool: %s of %s, %.2f GiB (%s)",
        plural(size.num_blocks, "block"),
        plural(block_size, "token"),
        size.num_bytes / GIB,
        size.reason,
    )
