"""The start-up self-check: every Mojo kernel a service will run, once, against the torch reference.

Compile-checked kernels can still fault, return NaN or be wrong on a device they never ran on.
So before a prefill or decode instance serves, each kernel it will call (attention prefill and
decode, the fused ops, on the CPU a MoE layer's grouped GEMM) runs once on small random inputs
of the model's own head geometry, block size and dtype, beside the torch reference on the same
inputs. A kernel fails when it raises, returns non-finite values, or differs by more than the
tolerance:

    error = max |kernel - reference| / max(max |reference|, 1)
    tolerance: 1e-4 in float32; 2e-2 in bfloat16 / float16 (a bit or two of their mantissa)

On CUDA the check runs in child processes (`python -m kernels.self_check`), one per family: an
illegal address poisons the whole CUDA context, so a kernel that faults must not run first in
the serving process, nor beside the other family's kernels. Each child loads the same kernels
and prints its findings as JSON; a child that dies (a signal, a timeout, no answer) fails every
kernel it was checking. On the CPU nothing is shared to poison, and the check runs in process.

What a failure means for the service (fall back or refuse) is `kernels/choice.py`'s business.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kernels.backend import select_attention, select_fused_ops
from mili.engine.model.attention import TorchAttention
from mili.engine.model.config import Qwen3Config
from mili.engine.model.fused_ops import TorchFusedOps

ATTENTION = "attention"
FUSED = "fused"
# A child imports torch, loads the PTX and makes six small launches: seconds, not minutes.
CHILD_TIMEOUT_S = 180.0
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
_EPS = 1e-6


@dataclass(frozen=True)
class CheckShape:
    """The model geometry the kernels are checked on (their specialisations follow it)."""

    num_heads: int  # H
    num_kv_heads: int  # KVH
    head_dim: int  # D
    block_size: int  # S
    dtype: str  # torch dtype name: float32, bfloat16, float16

    @classmethod
    def of(cls, config: Qwen3Config, block_size: int, dtype: str | None) -> CheckShape:
        """A model's shape; `dtype` None: the checkpoint's torch_dtype (as the loader does)."""
        return cls(
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            block_size,
            dtype or config.torch_dtype,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype) or dtype not in _TOLERANCE:
            raise ValueError(f"no self-check for dtype {self.dtype!r}")
        return dtype


class KernelFault(NamedTuple):
    """One kernel that failed the check."""

    family: str  # ATTENTION or FUSED: what falls back to torch together
    kernel: str  # e.g. "attention.decode", "fused.qk_norm_rope_kv"
    error: str  # what went wrong, for the start-up log line

    def __str__(self) -> str:
        return f"{self.kernel}: {self.error}"


# A case runs one kernel of an implementation (the Mojo one or the torch reference) on fresh
# copies of its inputs and returns every tensor it produced or wrote.
Case = Callable[[Any], tuple[torch.Tensor, ...]]


def check_kernels(
    shape: CheckShape, device: torch.device | str, implementations: dict[str, Any]
) -> list[KernelFault]:
    """Each kernel of `implementations` ({ATTENTION: backend, FUSED: ops}; a family left out is
    not checked) once against torch, in this process; the failures, empty if all passed."""
    device = torch.device(device)
    references = {ATTENTION: TorchAttention(), FUSED: TorchFusedOps()}
    tolerance = _TOLERANCE[shape.torch_dtype]
    faults = []
    for family, kernel, case in _cases(shape, device):
        if family not in implementations:
            continue
        implementation = implementations[family]
        if hasattr(implementation, "with_options"):  # CPU: on the worker pool, as served
            implementation = implementation.with_options(num_threads=None, always_parallel=True)
        try:
            actual = case(implementation)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # an asynchronous fault surfaces here
        except Exception as e:  # a kernel's failure, whatever its type, is what we report
            faults.append(KernelFault(family, kernel, f"raised {type(e).__name__}: {e}"))
            continue
        expected = case(references[family])
        error = _mismatch(actual, expected, tolerance)
        if error is not None:
            faults.append(KernelFault(family, kernel, error))
    return faults


def check_isolated(
    shape: CheckShape,
    device: str,
    families: Sequence[str],
    *,
    root: Path | None = None,
    timeout_s: float = CHILD_TIMEOUT_S,
) -> list[KernelFault]:
    """`check_kernels` of the Mojo kernels of `families` on `device` (as `load_family` loads
    them), each family in a child process with a CUDA context of its own: a fault sticks to
    the context it happened in, so one family's fault must not fail the other's kernels. The
    children run side by side; one that dies fails every kernel of its family."""

    def check(family: str) -> list[KernelFault]:
        command = [
            sys.executable, "-m", "kernels.self_check", "--device", device,
            "--families", family, "--shape", json.dumps(asdict(shape)),
        ]  # fmt: skip
        if root is not None:
            command += ["--root", str(root)]
        return run_child(command, [family], timeout_s=timeout_s)

    with ThreadPoolExecutor(max_workers=max(len(families), 1)) as pool:
        return [fault for faults in pool.map(check, families) for fault in faults]


def run_child(
    command: Sequence[str], families: Sequence[str], *, timeout_s: float
) -> list[KernelFault]:
    """Run a self-check child and read its answer: the JSON list of faults on its last line."""
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return _all_failed(families, f"the self-check process took over {timeout_s:.0f} s")
    except OSError as e:
        return _all_failed(families, f"cannot start the self-check process: {e}")
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        try:
            return [KernelFault(*fault) for fault in json.loads(lines[-1])]
        except (ValueError, TypeError):
            pass
    how = (
        f"was killed by signal {-done.returncode}"
        if done.returncode < 0
        else f"exited with status {done.returncode}"
    )
    tail = " | ".join(done.stderr.strip().splitlines()[-3:]) or "no output"
    return _all_failed(families, f"the self-check process {how}: {tail}")


def _all_failed(families: Sequence[str], error: str) -> list[KernelFault]:
    return [KernelFault(family, f"{family} (all kernels)", error) for family in families]


def _mismatch(
    actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], tolerance: float
) -> str | None:
    """Why `actual` is not `expected` within `tolerance`, or None when it is."""
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        what = f"output {index}" if len(actual) > 1 else "output"
        if a.shape != e.shape:
            return f"{what} has shape {tuple(a.shape)}, the reference {tuple(e.shape)}"
        a64, e64 = a.detach().double().cpu(), e.detach().double().cpu()
        if not torch.isfinite(a64).all():
            return f"{what} holds {int((~torch.isfinite(a64)).sum())} non-finite values"
        error = (a64 - e64).abs().max().item() / max(e64.abs().max().item(), 1.0)
        if error > tolerance:
            return f"{what} differs from the torch reference by {error:.3g} > {tolerance:g}"
    return None


# Block table width of the wide decode case: enough for the kernels to split each sequence.
_WIDE_TABLE = 256


def _cases(shape: CheckShape, device: torch.device) -> list[tuple[str, str, Case]]:
    """The kernels' cases on one set of random inputs (seeded: every run alike).

    Attention: two prompts packed in one prefill (a fresh one of 2S + 3 tokens; one with S + 1
    cached tokens and 5 new ones), and a decode of three sequences of 1, S and 2S + 5 tokens,
    so block boundaries, a partial last block and GQA are all crossed; that decode again over
    block tables as wide as a served model's (padded with the null block): the kernels then
    split each sequence (flash-decoding), most splits past its end, and combine the parts.
    """
    S, H, KVH, D = shape.block_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    dtype = shape.torch_dtype
    gen = torch.Generator().manual_seed(0)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * scale).to(dtype).to(device)

    def ints(values: Sequence[int] | Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    num_blocks = 8
    k_cache, v_cache = randn(num_blocks, S, KVH, D), randn(num_blocks, S, KVH, D)
    scale = D**-0.5
    # Prefill: sequence 0 fresh in blocks 1-3, sequence 1 cached up to S + 1 in blocks 4-5.
    lengths, starts = (2 * S + 3, 5), (0, S + 1)
    tables = ints([[1, 2, 3], [4, 5, 0]], torch.int32)
    cu_seqlens = ints([0, lengths[0], sum(lengths)], torch.int32)
    slots = [
        int(tables[i, p // S]) * S + p % S
        for i in range(2)
        for p in range(starts[i], starts[i] + lengths[i])
    ]
    flat = (-1, KVH, D)
    k_new, v_new = k_cache.view(flat)[slots], v_cache.view(flat)[slots]  # what the model wrote
    q_prefill = randn(sum(lengths), H, D)
    start_positions = ints(starts, torch.int32)
    # Decode: three sequences over blocks 6; 1, 2; 3, 4, 5.
    seq_lens = ints([1, S, 2 * S + 5], torch.int32)
    decode_tables = ints([[6, 0, 0], [1, 2, 0], [3, 4, 5]], torch.int32)
    q_decode = randn(3, H, D)

    def prefill(impl: Any) -> tuple[torch.Tensor, ...]:
        out = impl.prefill(
            q_prefill, k_new, v_new, cu_seqlens, start_positions, k_cache, v_cache, tables,
            scale=scale,
        )  # fmt: skip
        return (out,)

    def decode(impl: Any) -> tuple[torch.Tensor, ...]:
        return (impl.decode(q_decode, k_cache, v_cache, decode_tables, seq_lens, scale=scale),)

    # Qwen3's 40,960 positions are 2,560 columns of 16: 256 columns split as that does.
    wide_tables = torch.nn.functional.pad(decode_tables, (0, _WIDE_TABLE - 3))

    def decode_wide(impl: Any) -> tuple[torch.Tensor, ...]:
        return (impl.decode(q_decode, k_cache, v_cache, wide_tables, seq_lens, scale=scale),)

    # Fused ops: 5 tokens of a hidden size of H * D, an MLP of 2 H * D.
    T, hidden = 5, H * D
    x, residual, weight = randn(T, hidden), randn(T, hidden), randn(hidden, scale=0.5) + 1
    qkv = randn(T, (H + 2 * KVH) * D)
    q_weight, k_weight = randn(D, scale=0.5) + 1, randn(D, scale=0.5) + 1
    num_positions = 4 * S
    freqs = torch.arange(num_positions)[:, None] * (1e6 ** -(torch.arange(D // 2) / (D // 2)))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().to(device)  # [P, D]
    positions = ints([0, 1, S, S + 1, num_positions - 1], torch.int64)
    slot_mapping = ints([S + 0, S + 1, 3 * S + 2, 5 * S + S - 1, 7 * S], torch.int64)
    gate_up = randn(T, 4 * hidden)
    # A MoE layer's grouped GEMM: 6 rows over 4 experts (2, 0, 3, 1 rows: one with none).
    rows, experts = randn(6, hidden), randn(4, 2 * D, hidden, scale=hidden**-0.5)
    offsets = ints([2, 2, 5, 6], torch.int32)

    def rms_norm(impl: Any) -> tuple[torch.Tensor, ...]:
        return (impl.rms_norm(x.clone(), weight, _EPS),)

    def add_rms_norm(impl: Any) -> tuple[torch.Tensor, ...]:
        res = residual.clone()
        return impl.add_rms_norm(x.clone(), res, weight, _EPS), res

    def qk_norm_rope_kv(impl: Any) -> tuple[torch.Tensor, ...]:
        kc, vc = k_cache.clone(), v_cache.clone()
        q, k, v = impl.qk_norm_rope_kv(
            qkv.clone(), q_weight, k_weight, _EPS, cos_sin, positions, slot_mapping, kc, vc
        )
        return q, k, v, kc, vc

    def silu_mul(impl: Any) -> tuple[torch.Tensor, ...]:
        return (impl.silu_mul(gate_up.clone()),)

    # Projections at decode's batch sizes (1 and 4 rows: the GPU's gemv kernel) and past them.
    projection = randn(3 * hidden + 8, hidden, scale=hidden**-0.5)

    def linear(impl: Any) -> tuple[torch.Tensor, ...]:
        return tuple(impl.linear(x[:rows], projection, None) for rows in (1, 4, T))

    down = randn(hidden, 2 * hidden, scale=(2 * hidden) ** -0.5)

    def silu_mul_linear(impl: Any) -> tuple[torch.Tensor, ...]:
        return tuple(impl.silu_mul_linear(gate_up[:rows], down) for rows in (1, 4, T))

    def add_rms_norm_linear(impl: Any) -> tuple[torch.Tensor, ...]:
        out: list[torch.Tensor] = []
        for rows in (1, 4, T):
            for res in (residual[:rows].clone(), None):  # layer 0 has no residual yet
                y, r = impl.add_rms_norm_linear(
                    x[:rows].clone(), res, weight, _EPS, projection, None
                )
                out += [y, r]
        return tuple(out)

    def grouped_gemm(impl: Any) -> tuple[torch.Tensor, ...]:
        # The CPU's kernel itself: calls this small go to torch in `grouped_gemm`.
        kernel = getattr(impl, "grouped_gemm_kernel", impl.grouped_gemm)
        return (kernel(rows, experts, offsets),)

    cases: list[tuple[str, str, Case]] = [
        (ATTENTION, "attention.prefill", prefill),
        (ATTENTION, "attention.decode", decode),
        (ATTENTION, "attention.decode_split", decode_wide),
        (FUSED, "fused.rms_norm", rms_norm),
        (FUSED, "fused.add_rms_norm", add_rms_norm),
        (FUSED, "fused.qk_norm_rope_kv", qk_norm_rope_kv),
        (FUSED, "fused.silu_mul", silu_mul),
        (FUSED, "fused.linear", linear),
        (FUSED, "fused.silu_mul_linear", silu_mul_linear),
        (FUSED, "fused.add_rms_norm_linear", add_rms_norm_linear),
    ]
    if device.type == "cpu":  # CUDA runs torch's grouped GEMM: no kernel of ours to check
        cases.append((FUSED, "fused.grouped_gemm", grouped_gemm))
    return cases


def load_family(family: str, device: str, head_dim: int, root: Path | None = None) -> Any:
    """The Mojo implementation of one family for `device`; KernelBuildError if it cannot load."""
    if family == ATTENTION:
        return select_attention("mojo", device, head_dim=head_dim, root=root)
    if family == FUSED:
        return select_fused_ops("mojo", device, head_dim=head_dim, root=root)
    raise ValueError(f"no kernel family {family!r}")


def main(argv: Sequence[str] | None = None) -> None:
    """The child of `check_isolated`: load the kernels, check them, print the faults as JSON.

    A family whose kernels do not load is a fault of that family (the parent loaded them
    already, so this is rare: a PTX the driver rejects here, say).
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.self_check")
    parser.add_argument("--device", required=True)
    parser.add_argument("--root", type=Path, default=None, help="the kernel cache's root")
    parser.add_argument("--families", required=True)
    parser.add_argument("--shape", required=True, help="CheckShape as JSON")
    args = parser.parse_args(argv)
    shape = CheckShape(**json.loads(args.shape))
    faults: list[KernelFault] = []
    implementations = {}
    for family in args.families.split(","):
        try:
            implementations[family] = load_family(family, args.device, shape.head_dim, args.root)
        except Exception as e:  # reported to the parent, which decides
            faults.append(KernelFault(family, f"{family} (all kernels)", f"cannot load: {e}"))
    faults += check_kernels(shape, args.device, implementations)
    print(json.dumps([list(fault) for fault in faults]), flush=True)


if __name__ == "__main__":
    main()
