"""A decode instance's engine side, built once from DecodeConfig: the model runner (model, KV
cache, CUDA graphs), block pool, request table and batch loop, plus what Info reports."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from prometheus_client import CollectorRegistry

from kernels.build import KernelBuildError
from kernels.choice import select_kernels
from kernels.self_check import CheckShape
from mili.engine.constraint.compiler import CompileConfig, ConstraintCompiler, load_compiler
from mili.engine.constraint.mask import decode_mask_threads
from mili.engine.kv.block_pool import BlockPool
from mili.engine.model.config import ConfigError
from mili.engine.model.fingerprint import model_fingerprint, tokenizer_file_sha256
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.loader import CheckpointError, load_config
from mili.engine.step.ahead_check import check_ahead
from mili.engine.step.device import require_device
from mili.engine.step.runner import ModelRunner
from mili.engine.step.runner_info import RunnerInfo
from mili.engine.step.startup import load_runner
from mili.errors import StartupError
from mili.kv_handoff import kv_transport
from mili.kv_handoff.cuda_ipc import export_pool
from mili.kv_handoff.kv_transport import Endpoint, TransportConfig
from mili.kv_handoff.shm_segment import Segment
from mili.telemetry.metrics import DecodeMetrics, PrefixCacheCollector
from services.decode.batcher import Batcher
from services.decode.config import DEFAULT_KV_CACHE_BYTES, DecodeConfig
from services.decode.kv_writer import KVWriter
from services.decode.requests import RequestTable
from services.decode.stream import Outlets

_LOG = logging.getLogger("mili.decode")


@dataclass
class DecodeInstance(RunnerInfo):
    config: DecodeConfig
    runner: ModelRunner
    table: RequestTable
    batcher: Batcher
    kv_writer: KVWriter  # where landed prompt blocks go into the cache (grpc transport)
    fingerprint: str  # mili.engine.fingerprint.model_fingerprint of the checkpoint
    eos_token_ids: frozenset[int]
    metrics: DecodeMetrics
    endpoint: Endpoint  # this instance's side of KV pairs: host id, device, transports offered
    segment: Segment | None = None  # the shared-memory segment holding the KV pool ("shm")
    ipc_export: bytes = b""  # cuda_ipc.export_pool of the pool holding the KV cache ("cuda-ipc")
    # Where each admitted request's events go, by request id (the servicers' side of `table`).
    outlets: Outlets = field(default_factory=Outlets)
    # Compiles requests' constraints (structured output) for this model's tokenizer; None
    # without a tokenizer.json (constrained requests are then refused).
    constraints: ConstraintCompiler | None = None
    tokenizer_file_sha256: str = ""  # of the model directory's tokenizer.json; "" without one

    @classmethod
    def load(cls, config: DecodeConfig, metrics: DecodeMetrics | None = None) -> DecodeInstance:
        """Load the checkpoint, size and allocate the KV pool, capture the decode step's CUDA
        graphs; StartupError naming what is wrong.

        `metrics`: where the batch loop and KV transfers record (default: a private registry).
        """
        engine = config.engine
        require_device(engine.device)
        try:
            model_config = load_config(config.model_dir)
            kernels = select_kernels(
                engine.attention,
                engine.device,
                CheckShape.of(model_config, engine.block_size, engine.dtype),
            )
            fingerprint = model_fingerprint(config.model_dir)
            tokenizer_sha256 = tokenizer_file_sha256(config.model_dir)
        except KernelBuildError as e:
            raise StartupError(f"--attention {engine.attention}: {e}") from None
        except (CheckpointError, ConfigError, OSError) as e:
            raise StartupError(f"cannot load model from {config.model_dir}: {e}") from None
        transport = TransportConfig(config.kv_transport, config.host_id)
        endpoint = transport.endpoint(str(torch.device(engine.device)))
        # The KV pool (its blocks and the runner's null block) in memory a prefill can map.
        pool = _PoolStorage(endpoint, config.kv_transport, engine.device)
        try:
            runner = load_runner(
                config.model_dir,
                engine,
                attention=kernels.attention,
                fused_ops=kernels.fused_ops,
                max_decode_batch=config.max_running,
                capture_graphs=True,
                default_kv_bytes=DEFAULT_KV_CACHE_BYTES,
                storage=pool.allocate,
            )
        except BaseException:
            if pool.segment is not None:
                pool.segment.close()
            raise
        endpoint = pool.endpoint._replace(device=str(runner.model.device))
        blocks = BlockPool(runner.num_blocks, null_block=True)
        table = RequestTable(
            blocks, engine.block_size, config.max_running, prefix_caching=config.prefix_caching
        )
        if metrics is None:
            metrics = DecodeMetrics(CollectorRegistry())
        metrics.watch(
            num_waiting_requests=lambda: table.num_waiting,
            num_running_requests=lambda: table.num_running,
            num_preempted_requests=lambda: table.num_preempted,
            num_total_blocks=lambda: table.num_total_blocks,
            num_free_blocks=lambda: table.num_free_blocks,
        )
        PrefixCacheCollector(metrics.registry, "decode", table.prefix_cache_reading)
        eos = runner.model.eos_token_ids
        # a lane per mask thread: the batch's masks then fill in parallel (compiler.py)
        compile_config = CompileConfig(lanes=decode_mask_threads())
        constraints = load_compiler(
            config.model_dir, runner.model.config.vocab_size, eos, compile_config
        )
        overlap = config.overlaps_steps
        if overlap and (why := check_ahead(runner)) is not None:
            _LOG.warning(
                "decode steps will not overlap (--overlap-steps): the overlapped step's check "
                "on %s failed: %s",
                runner.device,
                why,
            )
            overlap = False
        batcher = Batcher(
            runner,
            table,
            eos_token_ids=eos,
            max_context_tokens=runner.model.config.max_context_tokens,
            metrics=metrics,
            constraints=constraints,
            overlap=overlap,
        )
        return cls(
            config,
            runner,
            table,
            batcher,
            KVWriter(runner.kv_cache),
            fingerprint,
            eos,
            metrics,
            endpoint,
            pool.segment,
            pool.ipc_export,
            constraints=constraints,
            tokenizer_file_sha256=tokenizer_sha256,
        )

    # ---- what Info reports (and RunnerInfo's) -------------------------------------------------

    @property
    def cache(self) -> KVCache:
        """The KV cache (its last block is the runner's null block)."""
        return self.runner.kv_cache

    @property
    def model_name(self) -> str:
        return self.config.model_dir.resolve().name

    @property
    def max_context_tokens(self) -> int:
        return self.model.config.max_context_tokens

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    @property
    def num_cuda_graphs(self) -> int:
        graphs = self.runner.graphs
        return 0 if graphs is None else len(graphs.batch_sizes)

    def describe(self) -> str:
        return (
            f"model {self.model_name} ({self.config.model_dir}) on {self.device} in {self.dtype}; "
            f"{self.runner.describe()}; attention {self.attention_backend}, "
            f"fused ops {self.fused_ops}; "
            f"max_running {self.config.max_running}; "
            f"steps {'overlapped' if self.batcher.overlap else 'one at a time'}; "
            f"eos {sorted(self.eos_token_ids)}; "
            f"KV transports {', '.join(self.endpoint.transports)}"
            + (f" (pool in {self.segment.path})" if self.segment is not None else "")
        )

    # ---- life cycle ----------------------------------------------------------------------------

    def start(self, on_death: Callable[[BaseException], None] | None = None) -> None:
        """`on_death`: Batcher.start's (what to do when its thread dies of a bug)."""
        self.batcher.start(on_death)
        _LOG.info("decode instance: %s", self.describe())

    def stop(self) -> None:
        self.batcher.stop()
        if self.segment is not None:
            self.segment.close()  # unlinks it: a restart maps a new one


class _PoolStorage:
    """load_runner's `storage` hook for decode: the KV pool in one exported CUDA
    allocation ("cuda-ipc") or in a POSIX shared-memory segment ("shm"), else None (the runner
    allocates it). A segment that cannot be made falls back to grpc unless shm was forced."""

    def __init__(self, endpoint: Endpoint, allowed: str, device: str) -> None:
        self.endpoint = endpoint
        self.allowed = allowed
        self.device = torch.device(device)
        self.segment: Segment | None = None
        self.ipc_export = b""

    def allocate(self, num_bytes: int) -> torch.Tensor | None:
        transports = self.endpoint.transports
        if kv_transport.CUDA_IPC in transports:
            # One allocation holding the whole pool: exported once, mapped by each prefill.
            flat = torch.zeros(num_bytes, dtype=torch.uint8, device=self.device)
            self.ipc_export = export_pool(flat)
            return flat
        if kv_transport.SHM in transports:
            # The pool in shared memory: a prefill on this host writes its blocks in place.
            try:
                self.segment = Segment.create(num_bytes)
            except OSError as e:
                if self.allowed == kv_transport.SHM:
                    raise StartupError(f"--kv-transport shm: {e}") from None
                _LOG.warning("KV pool not in shared memory (%s): KV arrives over grpc", e)
                self.endpoint = self.endpoint._replace(transports=(kv_transport.GRPC,))
                return None
            return self.segment.tensor
        return None
