"""A decode instance's engine side, built once from DecodeConfig: model, KV cache, block pool,
request table and batch loop, plus what Info reports about them."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from kernels.backend import select_attention
from kernels.build import KernelBuildError
from mili.engine.block_pool import BlockPool
from mili.engine.config import ConfigError, Qwen3Config
from mili.engine.fingerprint import model_fingerprint
from mili.engine.kv_cache import KVCache, bytes_per_block, dtype_name, num_blocks_for_budget
from mili.engine.kv_layout import KVLayout
from mili.engine.loader import CheckpointError, load_model, resolve_dtype
from mili.engine.model import Qwen3ForCausalLM
from mili.errors import StartupError
from mili.telemetry.metrics import DecodeMetrics
from services.decode.batcher import Batcher
from services.decode.config import DecodeConfig
from services.decode.requests import RequestTable

_LOG = logging.getLogger("mili.decode")
GENERATION_CONFIG = "generation_config.json"


def eos_token_ids(model_dir: Path, config: Qwen3Config) -> frozenset[int]:
    """End-of-sequence ids: generation_config.json's `eos_token_id`, else config.json's.

    Qwen3 chat checkpoints list two there (<|im_end|> and <|endoftext|>) but only one in
    config.json, so generation_config.json wins when present.
    """
    path = model_dir / GENERATION_CONFIG
    ids: object = config.eos_token_id
    if path.exists():
        try:
            generation = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise StartupError(f"{path} is not valid JSON: {e}") from None
        if isinstance(generation, dict) and generation.get("eos_token_id") is not None:
            ids = generation["eos_token_id"]
    if ids is None:
        return frozenset()
    listed = [ids] if isinstance(ids, int) else ids
    if not isinstance(listed, list) or not all(
        isinstance(i, int) and 0 <= i < config.vocab_size for i in listed
    ):
        raise StartupError(f"{model_dir}: eos_token_id {ids!r} is not a list of ids in the vocab")
    return frozenset(listed)


@dataclass
class DecodeInstance:
    config: DecodeConfig
    model: Qwen3ForCausalLM
    cache: KVCache
    table: RequestTable
    batcher: Batcher
    fingerprint: str  # mili.engine.fingerprint.model_fingerprint of the checkpoint
    eos_token_ids: frozenset[int]
    metrics: DecodeMetrics

    @classmethod
    def load(cls, config: DecodeConfig, metrics: DecodeMetrics | None = None) -> DecodeInstance:
        """Load the checkpoint and allocate the KV pool; StartupError naming what is wrong.

        `metrics`: where the batch loop and KV transfers record (default: a private registry).
        """
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise StartupError(f"--device {config.device}: no CUDA device is available")
        try:
            dtype = resolve_dtype(config.dtype) if config.dtype is not None else None
            model = load_model(config.model_dir, device=config.device, dtype=dtype)
            model.attention = select_attention(
                config.attention, model.device, head_dim=model.config.head_dim
            )
            fingerprint = model_fingerprint(config.model_dir)
        except KernelBuildError as e:
            raise StartupError(f"--attention {config.attention}: {e}") from None
        except (CheckpointError, ConfigError, OSError) as e:
            raise StartupError(f"cannot load model from {config.model_dir}: {e}") from None
        model_config = model.config
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(
                model_config, config.block_size, model.dtype, config.kv_cache_bytes
            )
            if num_blocks == 0:
                raise StartupError(
                    f"--kv-cache-bytes {config.kv_cache_bytes} holds no KV block of this model"
                )
        try:
            cache = KVCache(
                model_config, num_blocks, config.block_size, dtype=model.dtype, device=model.device
            )
        except (torch.OutOfMemoryError, RuntimeError) as e:
            size = num_blocks * bytes_per_block(model_config, config.block_size, model.dtype)
            raise StartupError(
                f"cannot allocate {num_blocks} KV blocks ({size} bytes) on {config.device}: {e}; "
                "lower --num-blocks or --kv-cache-bytes"
            ) from None
        table = RequestTable(BlockPool(num_blocks), config.block_size, config.max_running)
        if metrics is None:
            metrics = DecodeMetrics(CollectorRegistry())
        metrics.watch(
            num_waiting_requests=lambda: table.num_waiting,
            num_running_requests=lambda: table.num_running,
            num_total_blocks=lambda: table.num_total_blocks,
            num_free_blocks=lambda: table.num_free_blocks,
        )
        eos = eos_token_ids(config.model_dir, model_config)
        batcher = Batcher(
            model,
            cache,
            table,
            eos_token_ids=eos,
            max_context_tokens=model_config.max_position_embeddings,
            metrics=metrics,
        )
        return cls(config, model, cache, table, batcher, fingerprint, eos, metrics)

    # ---- what Info reports ---------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.config.model_dir.resolve().name

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
    def max_context_tokens(self) -> int:
        return self.model.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def layout(self) -> KVLayout:
        return self.cache.layout

    def describe(self) -> str:
        return (
            f"model {self.model_name} ({self.config.model_dir}) on {self.device} in {self.dtype}; "
            f"{self.cache.num_blocks} KV blocks of {self.cache.block_size} tokens; "
            f"attention {self.attention_backend}; max_running {self.config.max_running}; "
            f"eos {sorted(self.eos_token_ids)}"
        )

    # ---- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self.batcher.start()
        _LOG.info("decode instance: %s", self.describe())

    def stop(self) -> None:
        self.batcher.stop()
