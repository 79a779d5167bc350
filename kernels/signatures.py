"""The sm_90 attention kernels' PTX entries: which are built (KERNELS x kernel_dtypes x
HEAD_DIMS) and the parameter list each takes (SIGNATURES), against which kernels/ptx.py checks
every compiled entry and kernels/gpu.py every entry it loads (kernels/ptx_entry.py's
check_signature). HEAD_DIMS is also what kernels/checks.py accepts: the CPU kernels are
specialised on the same head dims.

No torch import: CI builds and checks the PTX on machines without a GPU.
"""

from __future__ import annotations

from kernels.geometry import DECODE_GROUP_SIZES
from mili.engine.kv.kv_layout import DTYPES  # one specialisation per dtype a service may run

HEAD_DIMS = (64, 128, 256)  # every Mojo attention kernel, CPU and GPU, is specialised on these
KERNELS = (
    "prefill",
    "decode",
    "decode_combine",
    "flash_prefill",
    "flash_prefill_3cta",  # flash_prefill's narrow variant at >= 3 CTAs an SM (an experiment)
    *(f"paged_decode_g{gc}" for gc in DECODE_GROUP_SIZES),
)
# Where spills cost the most: a build whose ptxas reports a spill here fails the CI check.
TENSOR_CORE_DTYPES = ("bfloat16", "float16")

# Kernel parameter lists, in order: "ptr" (a device pointer, .u64 in PTX), "i32", "f32"
# (both .b32). kernels/gpu.py packs its launch arguments from these; kernels/ptx.py checks every
# compiled entry against them (kernels/ptx_entry.py's check_signature), so the loader and the
# PTX cannot drift apart silently.
SIGNATURES: dict[str, tuple[tuple[str, str], ...]] = {
    "prefill": (
        ("out", "ptr"),
        ("q", "ptr"),
        ("k_cache", "ptr"),
        ("v_cache", "ptr"),
        ("cu_seqlens", "ptr"),
        ("start_positions", "ptr"),
        ("block_tables", "ptr"),
        ("num_q_heads", "i32"),
        ("num_kv_heads", "i32"),
        ("block_size", "i32"),
        ("max_blocks", "i32"),
        ("scale_log2", "f32"),
    ),
    "decode": (
        ("out", "ptr"),
        ("part_o", "ptr"),
        ("part_lse", "ptr"),
        ("q", "ptr"),
        ("k_cache", "ptr"),
        ("v_cache", "ptr"),
        ("block_tables", "ptr"),
        ("seq_lens", "ptr"),
        ("num_q_heads", "i32"),
        ("num_kv_heads", "i32"),
        ("block_size", "i32"),
        ("max_blocks", "i32"),
        ("num_splits", "i32"),
        ("scale_log2", "f32"),
    ),
    "decode_combine": (
        ("out", "ptr"),
        ("part_o", "ptr"),
        ("part_lse", "ptr"),
        ("num_splits", "i32"),
    ),
}
SIGNATURES["flash_prefill"] = SIGNATURES["prefill"]
SIGNATURES["flash_prefill_3cta"] = SIGNATURES["prefill"]
# paged_decode merges its splits itself: the last split of a (sequence, head group) to finish
# does, counted in `counters` (int32, one per CTA column, zero between launches).
_PAGED_DECODE = (*SIGNATURES["decode"][:3], ("counters", "ptr"), *SIGNATURES["decode"][3:])
for _gc in DECODE_GROUP_SIZES:
    SIGNATURES[f"paged_decode_g{_gc}"] = _PAGED_DECODE


def kernel_dtypes(kernel: str) -> tuple[str, ...]:
    """The dtypes a kernel is built for: tensor-core kernels take 2-byte inputs only."""
    return DTYPES if kernel in ("prefill", "decode", "decode_combine") else TENSOR_CORE_DTYPES
