"""How prefill and decode run the engine: one frozen EngineConfig, built once from the flags
`add_engine_arguments` adds to both services' parsers.

Torch-free on purpose: `mili --help` builds every service's parser, and the parser's defaults
come from here.

The KV pool is sized, first rule that applies:

    --num-blocks N          N blocks
    --kv-cache-bytes B      B // bytes per block
    CUDA                    from device memory: (total x --gpu-memory-utilization - peak use)
                            after the weights load and a warm-up at the largest batch
                            (mili.engine.kv_memory)
    CPU                     the service's default budget
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from mili.engine.kv.kv_layout import DEFAULT_BLOCK_SIZE, DTYPES

# --attention values: the engine owns the attention interface (mili.engine.model.attention), so it
# owns the list; kernels/choice.py select_kernels says what each means.
ATTENTION_CHOICES = ("auto", "mojo", "torch")
DEFAULT_ATTENTION = "auto"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_WATCHDOG_TIMEOUT_S = 300.0  # SGLang's default for the same watchdog
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class EngineConfig:
    """Device, element type, KV pool and execution mode of one engine (one model copy)."""

    device: str = "cpu"
    dtype: str | None = None  # None: the checkpoint's torch_dtype
    block_size: int = DEFAULT_BLOCK_SIZE
    attention: str = DEFAULT_ATTENTION  # auto: Mojo kernels where they build, else torch
    kv_cache_bytes: int | None = None  # set: the pool's size in bytes
    num_blocks: int | None = None  # set: the pool's size in blocks (wins over everything)
    # CUDA: the fraction of the device's memory this process may fill (weights, activations,
    # KV pool, CUDA graphs). Two processes on one GPU each get their share (mili serve).
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enforce_eager: bool = False  # CUDA: never capture CUDA graphs
    # Seconds the engine thread may spend in one step before the service stops itself
    # (mili/watchdog.py); 0: never. Long enough for a CPU prefill step of a full batch.
    watchdog_timeout_s: float = DEFAULT_WATCHDOG_TIMEOUT_S

    def __post_init__(self) -> None:
        if not _DEVICE.match(self.device):
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size (--block-size) must be > 0, got {self.block_size}")
        if self.attention not in ATTENTION_CHOICES:
            choices = ", ".join(ATTENTION_CHOICES)
            raise ValueError(f"--attention must be one of {choices}, got {self.attention!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"--kv-cache-bytes must be > 0, got {self.kv_cache_bytes}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"--num-blocks must be > 0, got {self.num_blocks}")
        if self.kv_cache_bytes is not None and self.num_blocks is not None:
            raise ValueError("--kv-cache-bytes and --num-blocks both size the KV pool; give one")
        if not self.watchdog_timeout_s >= 0:  # NaN too
            raise ValueError(f"--watchdog-timeout must be >= 0, got {self.watchdog_timeout_s}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(
            device=args.device,
            dtype=args.dtype,
            block_size=args.block_size,
            attention=args.attention,
            kv_cache_bytes=args.kv_cache_bytes,
            num_blocks=args.num_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=args.enforce_eager,
            watchdog_timeout_s=args.watchdog_timeout,
        )


def add_engine_arguments(parser: argparse.ArgumentParser, *, default_pool: str) -> None:
    """The engine flags prefill and decode share; `default_pool` says what the service's KV
    pool holds on CPU when neither --kv-cache-bytes nor --num-blocks is given."""
    defaults = EngineConfig()
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--device", default=defaults.device, help="cpu, cuda or cuda:N (default: %(default)s)"
    )
    group.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="weights' and KV cache's element type (default: the fastest on the device: "
        "float32 on CPU, bfloat16 on CUDA)",
    )
    group.add_argument(
        "--block-size",
        type=int,
        default=defaults.block_size,
        help="tokens per KV block; prefill and decode must use the same (default: %(default)s)",
    )
    group.add_argument(
        "--attention",
        default=defaults.attention,
        choices=ATTENTION_CHOICES,
        help="attention backend: mojo kernels, the torch reference, or auto = mojo where the "
        "kernels build for the device, else torch (default: %(default)s)",
    )
    pool = group.add_mutually_exclusive_group()
    pool.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help=f"KV pool size in bytes (default: on CUDA from --gpu-memory-utilization; on CPU "
        f"{default_pool})",
    )
    pool.add_argument(
        "--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides all else)"
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=defaults.gpu_memory_utilization,
        metavar="FRACTION",
        help="CUDA: fraction of the device's memory this process fills with weights, "
        "activations, CUDA graphs and the KV pool, which gets what the others leave "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--no-prefix-cache",
        dest="prefix_caching",
        action="store_false",
        help="no prefix caching: prefill computes and sends every prompt in full, decode frees "
        "every finished request's blocks, instead of keeping the KV of full blocks for later "
        "prompts that share them",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run every decode step eagerly, capturing no CUDA graphs",
    )
    group.add_argument(
        "--watchdog-timeout",
        type=float,
        default=defaults.watchdog_timeout_s,
        metavar="SECONDS",
        help="an engine step (a forward and its sampling) still running after SECONDS means "
        "the engine is stuck (a kernel or driver that never returns): the service logs it "
        "and exits 1, for mili serve or Kubernetes to start a fresh one; 0: never "
        "(default: %(default)s)",
    )
