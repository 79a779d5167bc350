"""A prefill instance's engine side, built once from PrefillConfig: the model runner (model,
KV cache), block pool, scheduler and worker thread, plus what Info reports about them.

The mirror of services/decode/instance.py: the servicer (server.py) only converts messages and
drives the KV transfer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from kernels.build import KernelBuildError
from kernels.choice import select_kernels
from kernels.self_check import CheckShape
from mili.engine.constraint.compiler import ConstraintCompiler, load_compiler
from mili.engine.constraint.mask import BatchMasker
from mili.engine.kv.block_pool import BlockPool
from mili.engine.model.config import ConfigError
from mili.engine.model.fingerprint import model_fingerprint, tokenizer_file_sha256
from mili.engine.model.loader import CheckpointError, load_config
from mili.engine.step.device import require_device
from mili.engine.step.runner import ModelRunner
from mili.engine.step.runner_info import RunnerInfo
from mili.engine.step.startup import load_runner
from mili.errors import StartupError
from mili.telemetry.metrics import PrefillMetrics, PrefixCacheCollector
from services.prefill.config import PrefillConfig
from services.prefill.scheduler import Scheduler
from services.prefill.worker import PrefillWorker

_LOG = logging.getLogger("mili.prefill")


@dataclass
class PrefillInstance(RunnerInfo):
    config: PrefillConfig
    runner: ModelRunner
    scheduler: Scheduler
    worker: PrefillWorker
    model_name: str
    fingerprint: str  # mili.engine.fingerprint.model_fingerprint of the checkpoint
    metrics: PrefillMetrics
    # Compiles requests' constraints for this model's tokenizer (the first token is masked by
    # them); None without a tokenizer.json (constrained requests are then refused).
    constraints: ConstraintCompiler | None = None
    tokenizer_file_sha256: str = ""  # of the model directory's tokenizer.json; "" without one

    @classmethod
    def load(
        cls, config: PrefillConfig, model_dir: Path, metrics: PrefillMetrics | None = None
    ) -> PrefillInstance:
        """Load the checkpoint and allocate the KV pool; StartupError naming what is wrong.

        The pool: --num-blocks or --kv-cache-bytes; else on CUDA what device memory leaves,
        at most `config.max_queued_blocks`; else (CPU) exactly that many.
        """
        engine = config.engine
        require_device(engine.device)
        try:
            model_config = load_config(model_dir)
            kernels = select_kernels(
                engine.attention,
                engine.device,
                CheckShape.of(model_config, engine.block_size, engine.dtype),
            )
            fingerprint = model_fingerprint(model_dir)
            tokenizer_sha256 = tokenizer_file_sha256(model_dir)
        except KernelBuildError as e:
            raise StartupError(f"--attention {engine.attention}: {e}") from None
        except (CheckpointError, ConfigError, OSError) as e:
            raise StartupError(f"cannot load model from {model_dir}: {e}") from None
        runner = load_runner(
            model_dir,
            engine,
            attention=kernels.attention,
            fused_ops=kernels.fused_ops,
            max_decode_batch=1,  # prefill runs no decode step
            capture_graphs=False,
            capture_prefill_graphs=True,
            max_prefill_tokens=config.max_batch_tokens,
            default_num_blocks=config.max_queued_blocks,
            max_useful_blocks=config.max_queued_blocks,
        )
        rows = runner.model.config.vocab_size
        eos = runner.model.eos_token_ids
        return cls.create(
            runner,
            config,
            model_name=model_dir.name,
            fingerprint=fingerprint,
            metrics=metrics,
            constraints=load_compiler(model_dir, rows, eos),
            tokenizer_file_sha256=tokenizer_sha256,
            eos_token_ids=eos,
        )

    @classmethod
    def create(
        cls,
        runner: ModelRunner,
        config: PrefillConfig,
        *,
        model_name: str,
        fingerprint: str,
        metrics: PrefillMetrics | None = None,
        constraints: ConstraintCompiler | None = None,
        tokenizer_file_sha256: str = "",
        eos_token_ids: Collection[int] = (),
    ) -> PrefillInstance:
        """An instance over a runner already built (tests and benchmarks share one model).
        `eos_token_ids`: the model's, which min_tokens holds back from the first token as
        decode does from the rest (besides the ones the frontend puts in the stop ids)."""
        if runner.block_size != config.engine.block_size:
            raise ValueError(
                f"the runner's block size {runner.block_size} is not the config's "
                f"{config.engine.block_size}"
            )
        scheduler = Scheduler(
            BlockPool(runner.num_blocks, null_block=True),
            block_size=runner.block_size,
            max_batch_tokens=config.max_batch_tokens,
            max_queued_tokens=config.max_queued_tokens,
            prefix_caching=config.prefix_caching,
        )
        metrics = PrefillMetrics(CollectorRegistry()) if metrics is None else metrics
        masker = None if constraints is None else BatchMasker(constraints.tokenizer, 8)
        worker = PrefillWorker(
            runner, scheduler, metrics=metrics, masker=masker, eos_token_ids=eos_token_ids
        )
        metrics.watch(
            num_queued_tokens=lambda: worker.num_queued_tokens,
            num_queued_requests=lambda: worker.num_queued_requests,
            num_waiting_requests=lambda: worker.num_waiting_requests,
            num_total_blocks=lambda: worker.num_total_blocks,
            num_free_blocks=lambda: worker.num_free_blocks,
        )
        PrefixCacheCollector(metrics.registry, "prefill", worker.prefix_cache_reading)
        return cls(
            config,
            runner,
            scheduler,
            worker,
            model_name,
            fingerprint,
            metrics,
            constraints,
            tokenizer_file_sha256,
        )

    # ---- what Info reports (and RunnerInfo's) -------------------------------------------------

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt accepted: the model's context, the queue bound and the whole pool."""
        return min(self.model.config.max_context_tokens, self.scheduler.max_prompt_tokens())

    @property
    def num_cuda_graphs(self) -> int:
        graphs = self.runner.prefill_graphs
        return 0 if graphs is None else len(graphs.token_sizes)

    def describe(self) -> str:
        config = self.config
        return (
            f"on {self.device}: dtype {self.dtype}, "
            f"{self.runner.describe(decode=False)}, attention {self.attention_backend}, "
            f"fused ops {self.fused_ops}, "
            f"max_batch_tokens {config.max_batch_tokens}, "
            f"max_queued_tokens {config.max_queued_tokens}, "
            f"KV to {', '.join(config.allowed_decodes)}"
        )

    # ---- life cycle ----------------------------------------------------------------------------

    def start(self, on_death: Callable[[BaseException], None] | None = None) -> None:
        self.worker.start(on_death)

    def stop(self) -> None:
        self.worker.stop()
