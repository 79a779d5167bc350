"""The fused elementwise kernels (kernels/fused/) against their one torch reference,
mili.engine.fused_ops.TorchFusedOps, over a grid of shapes.

Tolerances: fp32 within 4e-6 of the output's magnitude (the kernels sum RMSNorm's squares and
take exp in another order than torch: a few ulp); bf16/fp16 within 2e-2 (the kernels round where
torch rounds, so most elements are bit-equal, but the fp32 sum may tip a rounding).
Grid: odd token counts (1, 7, 17, 100), head_dim 64 and 128, q/kv head ratios 1, 2, 4, 8, KV
writes into slots that straddle block boundaries, widths with a tail shorter than a SIMD vector.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fused.checks import check_qk_norm_rope
from mili.engine.model.fused_ops import FusedOps, TorchFusedOps

REFERENCE = TorchFusedOps()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKENS = (1, 7, 17, 100)
EPS = 1e-6


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tolerance = 4e-6 if expected.dtype == torch.float32 else 2e-2
    scale = max(expected.float().abs().max().item(), 1.0)
    error = (actual.float() - expected.float()).abs().max().item()
    assert error <= tolerance * scale, f"max error {error} > {tolerance} x {scale}"


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", (64, 100, 1024))
@pytest.mark.parametrize("rows", TOKENS)
@pytest.mark.parametrize("with_residual", (False, True))
def test_add_rms_norm(
    fused_kernels: FusedOps, rows: int, dim: int, dtype: torch.dtype, with_residual: bool
) -> None:
    x = _randn(rows, dim, dtype=dtype, seed=rows)
    residual = _randn(rows, dim, dtype=dtype, seed=dim)
    weight = _randn(dim, dtype=dtype, seed=1)
    if not with_residual:
        assert_close(fused_kernels.rms_norm(x, weight, EPS), REFERENCE.rms_norm(x, weight, EPS))
        return
    expected_residual = residual.clone()
    expected = REFERENCE.add_rms_norm(x.clone(), expected_residual, weight, EPS)
    actual = fused_kernels.add_rms_norm(x.clone(), residual, weight, EPS)
    assert torch.equal(residual, expected_residual)  # the add rounds exactly as torch's
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", (96, 99, 3072))
@pytest.mark.parametrize("rows", TOKENS)
def test_silu_mul(
    fused_kernels: FusedOps, rows: int, intermediate: int, dtype: torch.dtype
) -> None:
    gate_up = _randn(rows, 2 * intermediate, dtype=dtype, seed=intermediate) * 4
    assert_close(fused_kernels.silu_mul(gate_up), REFERENCE.silu_mul(gate_up))


def _rope_case(
    tokens: int, ratio: int, head_dim: int, dtype: torch.dtype, block_size: int = 16
) -> dict[str, torch.Tensor]:
    kv_heads = 2
    heads = kv_heads * ratio
    num_blocks = 2 * tokens // block_size + 3
    g = torch.Generator().manual_seed(tokens * 31 + head_dim + ratio)
    # Consecutive slots from 13 onwards in a shuffled block order: the run crosses blocks.
    order = torch.randperm(num_blocks, generator=g)
    logical = torch.arange(13, 13 + tokens)
    slots = order[logical // block_size] * block_size + logical % block_size
    return {
        "qkv": _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=tokens),
        "q_weight": _randn(head_dim, dtype=dtype, seed=2),
        "k_weight": _randn(head_dim, dtype=dtype, seed=3),
        "cos_sin": torch.rand(512, head_dim, generator=g) * 2 - 1,
        "positions": torch.randint(0, 512, (tokens,), generator=g),
        "slot_mapping": slots,
        "k_cache": _randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=4),
        "v_cache": _randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=5),
    }


def _run_rope(ops: FusedOps, case: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    c = {name: t.clone() for name, t in case.items()}
    q, k, v = ops.qk_norm_rope_kv(
        c["qkv"],
        c["q_weight"],
        c["k_weight"],
        EPS,
        c["cos_sin"],
        c["positions"],
        c["slot_mapping"],
        c["k_cache"],
        c["v_cache"],
    )
    return [q, k, v, c["k_cache"], c["v_cache"]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("ratio", (1, 2, 4, 8))
@pytest.mark.parametrize("tokens", TOKENS)
def test_qk_norm_rope_kv(
    fused_kernels: FusedOps, tokens: int, ratio: int, head_dim: int, dtype: torch.dtype
) -> None:
    case = _rope_case(tokens, ratio, head_dim, dtype)
    expected = _run_rope(REFERENCE, case)
    actual = _run_rope(fused_kernels, case)
    for name, a, e in zip(("q", "k", "v", "k_cache", "v_cache"), actual, expected, strict=True):
        assert a.shape == e.shape, name
        assert_close(a.contiguous(), e.contiguous())
    # Slots not in slot_mapping keep their old values (the reference leaves them alone too).
    assert torch.equal(actual[4], expected[4])


def test_qk_norm_rope_rejects_out_of_range_indices(fused_kernels: FusedOps) -> None:
    case = _rope_case(7, 2, 64, torch.float32)
    case["slot_mapping"][3] = case["k_cache"].shape[0] * case["k_cache"].shape[1]
    with pytest.raises(ValueError, match="slot_mapping must lie in"):
        _run_rope(fused_kernels, case)
    case = _rope_case(7, 2, 64, torch.float32)
    case["positions"][0] = -1
    with pytest.raises(ValueError, match="positions must lie in"):
        _run_rope(fused_kernels, case)


def test_checks_name_the_argument() -> None:
    case = _rope_case(3, 1, 64, torch.float32)
    with pytest.raises(ValueError, match="cos_sin has dtype"):
        check_qk_norm_rope(
            case["qkv"],
            case["q_weight"],
            case["k_weight"],
            case["cos_sin"].double(),
            case["positions"],
            case["slot_mapping"],
            case["k_cache"],
            case["v_cache"],
        )
