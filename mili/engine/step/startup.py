"""A ModelRunner's start-up (`load_runner`): the checkpoint loaded, the KV pool sized (after a
warm-up that measures the device memory a step takes) and allocated, the steps' CUDA graphs
captured where they may be; and the start-up logs."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from mili.engine.engine_config import EngineConfig
from mili.engine.kv.block_pool import blocks_needed
from mili.engine.kv_memory import GIB, DeviceMemory, KvPoolSize, check_weights_fit, plan_kv_pool
from mili.engine.model import grouped_gemm
from mili.engine.model.attention import AttentionBackend
from mili.engine.model.config import ConfigError, Qwen3Config
from mili.engine.model.fused_ops import FusedOps
from mili.engine.model.kv_cache import KVCache, bytes_per_block, dtype_name
from mili.engine.model.loader import (
    CheckpointError,
    load_config,
    load_model,
    resolve_dtype,
    tokenizer_vocab_size,
)
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.model.sizing import num_parameters, weight_bytes
from mili.engine.step.device import require_device, use_device
from mili.engine.step.runner import ModelRunner
from mili.errors import StartupError
from mili.plural import plural

_LOG = logging.getLogger("mili.engine")


def load_runner(
    model_dir: Path,
    config: EngineConfig,
    *,
    attention: AttentionBackend,
    fused_ops: FusedOps | None = None,
    max_decode_batch: int,
    capture_graphs: bool,
    capture_prefill_graphs: bool = False,
    max_prefill_tokens: int | None = None,
    default_kv_bytes: int | None = None,
    default_num_blocks: int | None = None,
    max_useful_blocks: int | None = None,
    storage: Callable[[int], torch.Tensor | None] | None = None,
) -> ModelRunner:
    """Load the checkpoint, size and allocate the KV pool, capture graphs; StartupError
    naming what is wrong. The sampler draws only the ids of the directory's tokenizer.json
    (every row of the model without one).

    `capture_graphs`: whether this engine runs decode steps (decode: yes, prefill: no);
    `capture_prefill_graphs`: whether its prefill steps of up to `max_prefill_tokens`
    replay graphs (prefill's service: yes). Graphs are captured only on CUDA, without
    --enforce-eager, over a graph-safe backend.
    The pool's defaults and cap: kv_memory.plan_kv_pool.

    `storage`: given the whole pool's byte count (its blocks plus the null block), a flat
    zero-filled uint8 tensor to carve the KV cache from (a shared-memory segment, an
    exported CUDA allocation: KVCache's `storage`), or None to allocate it here.
    """
    require_device(config.device)
    device = torch.device(config.device)
    use_device(device)  # graph capture and the pool's events below
    try:
        dtype = resolve_dtype(config.dtype) if config.dtype is not None else None
        model_config = load_config(model_dir)
        weights_dtype = dtype or resolve_dtype(model_config.torch_dtype)
        check_device_fits(model_config, config, device, weights_dtype)
        model = load_model(
            model_dir, device=device, dtype=dtype, attention=attention, fused_ops=fused_ops
        )
        vocab_size = tokenizer_vocab_size(model_dir)
    except (CheckpointError, ConfigError, OSError, RuntimeError, ValueError) as e:
        raise StartupError(f"cannot load model from {model_dir}: {e}") from None
    if vocab_size is not None and vocab_size > model.config.vocab_size:
        raise StartupError(
            f"{model_dir}: tokenizer.json has {vocab_size} token ids, more than the "
            f"model's {model.config.vocab_size} embedding rows"
        )
    log_model(model)
    log_vocab(model_dir, vocab_size, model.config.vocab_size)
    use_graphs = capture_graphs and device.type == "cuda" and graphs_allowed(config, model)
    use_prefill_graphs = (
        capture_prefill_graphs
        and max_prefill_tokens is not None
        and device.type == "cuda"
        and graphs_allowed(config, model)
    )

    memory = None
    if device.type == "cuda" and config.num_blocks is None and config.kv_cache_bytes is None:
        memory = measure_memory(
            model, config, max_decode_batch, max_prefill_tokens, full_width=use_graphs
        )
    block_bytes = bytes_per_block(model.config, config.block_size, model.dtype)
    try:
        size = plan_kv_pool(
            config,
            block_bytes,
            memory=memory,
            default_bytes=default_kv_bytes,
            default_num_blocks=default_num_blocks,
            max_useful_blocks=max_useful_blocks,
        )
    except ValueError as e:
        raise StartupError(str(e)) from None
    log_pool(size, config.block_size)
    try:
        flat = None
        if storage is not None:
            flat = storage((size.num_blocks + 1) * block_bytes)
        cache = KVCache(
            model.config, size.num_blocks + 1, config.block_size, dtype=model.dtype,
            device=device, storage=flat,
        )  # fmt: skip
    except (torch.OutOfMemoryError, RuntimeError, OSError) as e:
        raise StartupError(
            f"cannot allocate {size.num_blocks} KV blocks ({size.num_bytes} bytes) on "
            f"{config.device}: {e}; lower --num-blocks or --kv-cache-bytes"
        ) from None
    runner = ModelRunner(model, cache, max_decode_batch=max_decode_batch, vocab_size=vocab_size)
    if use_graphs:
        runner.capture_graphs()
    if use_prefill_graphs:
        assert max_prefill_tokens is not None
        runner.capture_prefill_graphs(max_prefill_tokens)
    return runner


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
    runner = ModelRunner(model, cache, max_decode_batch=max_decode_batch)
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
