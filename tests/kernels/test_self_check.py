"""The start-up self-check (kernels/self_check.py) and what a service does with its verdict
(kernels/choice.py): `auto` falls back per family, `mojo` refuses, Info says what runs."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from kernels.build import KernelBuildError
from kernels.choice import load_family, select_kernels
from kernels.self_check import (
    ATTENTION,
    FUSED,
    CheckShape,
    check_isolated,
    check_kernels,
    run_child,
)
from mili.engine.engine_config import EngineConfig
from mili.engine.model.attention import TorchAttention
from mili.engine.model.fused_ops import TorchFusedOps
from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
from services.decode.config import DecodeConfig
from services.prefill.config import PrefillConfig
from services.prefill.instance import PrefillInstance
from tests.decode.harness import DecodeServerThread

# The demo model's geometry (head_dim 64, GQA 2) and Qwen3-0.6B's (head_dim 128, GQA 2).
DEMO = CheckShape(num_heads=8, num_kv_heads=4, head_dim=64, block_size=16, dtype="float32")
QWEN3_06B = CheckShape(num_heads=16, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")


class Broken:
    """A kernel implementation made to fail one way: wraps the torch reference of its family
    and breaks the results of `kernel` (or of every call)."""

    def __init__(self, family: str, how: str, kernel: str | None = None) -> None:
        self._inner: Any = TorchAttention() if family == ATTENTION else TorchFusedOps()
        self._how = how
        self._kernel = kernel
        self.name = "mojo"
        self.is_graph_safe = False

    def __getattr__(self, method: str) -> Any:
        call = getattr(self._inner, method)
        if self._kernel not in (None, method):
            return call

        def broken(*args: Any, **kwargs: Any) -> Any:
            if self._how == "raises":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            out = call(*args, **kwargs)
            first = out[0] if isinstance(out, tuple) else out
            if self._how == "nan":
                first[0, 0] = float("nan")
            else:  # "wrong": off by 0.5 everywhere, well past any tolerance
                first.add_(0.5)
            return out

        return broken


def _loader(broken: dict[str, Broken]) -> Any:
    """A `select_kernels` loader: the real Mojo kernels, except the families in `broken`."""

    def load(family: str, device: str, head_dim: int, root: Path | None = None) -> Any:
        return broken.get(family) or load_family(family, device, head_dim, root)

    return load


@pytest.mark.parametrize("shape", [DEMO, QWEN3_06B], ids=["demo", "qwen3-0.6b-bf16"])
def test_the_real_cpu_kernels_pass(shape: CheckShape) -> None:
    loaded = {family: load_family(family, "cpu", shape.head_dim) for family in (ATTENTION, FUSED)}
    assert check_kernels(shape, "cpu", loaded) == []


@pytest.mark.parametrize("how", ["raises", "nan", "wrong"])
@pytest.mark.parametrize(
    ("family", "kernel", "method"),
    [
        (ATTENTION, "attention.prefill", "prefill"),
        (ATTENTION, "attention.decode", "decode"),
        (FUSED, "fused.rms_norm", "rms_norm"),
        (FUSED, "fused.add_rms_norm", "add_rms_norm"),
        (FUSED, "fused.qk_norm_rope_kv", "qk_norm_rope_kv"),
        (FUSED, "fused.silu_mul", "silu_mul"),
        (FUSED, "fused.linear", "linear"),
        (FUSED, "fused.silu_mul_linear", "silu_mul_linear"),
        (FUSED, "fused.add_rms_norm_linear", "add_rms_norm_linear"),
        (FUSED, "fused.grouped_gemm", "grouped_gemm"),
    ],
)
def test_each_kernel_is_caught_however_it_fails(
    family: str, kernel: str, method: str, how: str
) -> None:
    implementations = {family: Broken(family, how, method)}
    faults = check_kernels(DEMO, "cpu", implementations)
    kernels = [kernel, "attention.decode_split"] if method == "decode" else [kernel]
    assert [(f.family, f.kernel) for f in faults] == [(family, k) for k in kernels]
    expected = {"raises": "illegal memory access", "nan": "non-finite", "wrong": "differs"}
    assert expected[how] in faults[0].error


def test_a_decode_wrong_only_when_it_splits_is_caught() -> None:
    """Served models' block tables are thousands of columns wide: the kernels split each
    sequence and combine the parts, a path short tables never take (the check once missed
    it). Wrong there alone, a kernel fails attention.decode_split."""

    class WrongWhenWide(TorchAttention):
        def decode(self, q: torch.Tensor, k: Any, v: Any, tables: Any, *a: Any, **kw: Any) -> Any:
            out = super().decode(q, k, v, tables, *a, **kw)
            return out + 0.5 if tables.shape[1] > 8 else out

    faults = check_kernels(DEMO, "cpu", {ATTENTION: WrongWhenWide()})
    assert [f.kernel for f in faults] == ["attention.decode_split"]


def test_a_bit_of_bf16_rounding_is_not_a_fault() -> None:
    # The torch reference against itself, once in float32 and once rounded through bfloat16:
    # the kind of difference a correct bf16 kernel shows.
    class Rounded(TorchAttention):
        def decode(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return super().decode(q, *args, **kwargs).bfloat16().float()

    shape = CheckShape(8, 4, 64, 16, "float32")
    assert check_kernels(shape, "cpu", {ATTENTION: Rounded()}) != []  # fp32's bar is tight
    bf16 = CheckShape(8, 4, 64, 16, "bfloat16")
    assert check_kernels(bf16, "cpu", {ATTENTION: TorchAttention()}) == []


@pytest.mark.parametrize("how", ["raises", "nan", "wrong"])
def test_auto_falls_back_per_family_and_says_which_kernel(how: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="mili.kernels"):
        kernels = select_kernels(
            "auto", "cpu", DEMO, load=_loader({FUSED: Broken(FUSED, how, "silu_mul")})
        )
    # The fused ops fell back to the reference; the attention kernels passed and stay Mojo.
    assert isinstance(kernels.fused_ops, TorchFusedOps)
    assert kernels.attention.name == "mojo" and not isinstance(kernels.attention, TorchAttention)
    assert [f.kernel for f in kernels.faults] == ["fused.silu_mul"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fused.silu_mul" in warnings[0], warnings


class FallsBack(Broken):
    """A family that can do without its broken kernel (as the GPU's gemv and split decode
    can): `fall_back` of that kernel's self-check name mends it, any other refuses."""

    def __init__(self, family: str, how: str, kernel: str, check_name: str) -> None:
        super().__init__(family, how, kernel)
        self._check_name = check_name
        self.fallen_back: list[str] = []

    def fall_back(self, kernel: str) -> bool:
        if kernel != self._check_name:
            return False
        self.fallen_back.append(kernel)
        self._kernel = "none of them"  # the broken method now runs the reference
        return True


def test_auto_does_without_a_failing_kernel_its_family_can_spare(caplog) -> None:
    fused = FallsBack(FUSED, "wrong", "linear", "fused.linear")
    with caplog.at_level(logging.WARNING, logger="mili.kernels"):
        kernels = select_kernels("auto", "cpu", DEMO, load=_loader({FUSED: fused}))
    assert kernels.fused_ops is fused and fused.fallen_back == ["fused.linear"]
    assert [f.kernel for f in kernels.faults] == ["fused.linear"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the other fused-op kernels stay" in warnings[0], warnings
    # the mended family passes the check now
    assert check_kernels(DEMO, "cpu", {FUSED: fused}) == []
    # a kernel the family cannot spare still sends the whole family to torch
    unsparing = FallsBack(FUSED, "wrong", "silu_mul", "fused.linear")
    kernels = select_kernels("auto", "cpu", DEMO, load=_loader({FUSED: unsparing}))
    assert isinstance(kernels.fused_ops, TorchFusedOps) and unsparing.fallen_back == []
    # and `mojo` refuses it all the same
    again = FallsBack(FUSED, "wrong", "linear", "fused.linear")
    with pytest.raises(KernelBuildError, match=r"fused\.linear"):
        select_kernels("mojo", "cpu", DEMO, load=_loader({FUSED: again}))


def test_the_gpu_families_spare_their_gemv_and_split_decode_only(tmp_path: Path) -> None:
    from kernels.fused.gpu import GpuFusedKernels
    from kernels.gpu import GpuKernels

    attention, fused = GpuKernels(tmp_path), GpuFusedKernels(tmp_path)
    assert (attention.split_decode, fused.gemv) == (True, True)
    assert not attention.fall_back("attention.decode") and not fused.fall_back("fused.silu_mul")
    assert (attention.split_decode, fused.gemv) == (True, True)
    assert attention.fall_back("attention.decode_split") and fused.fall_back("fused.linear")
    assert (attention.split_decode, fused.gemv) == (False, False)
    for kernel in ("fused.silu_mul_linear", "fused.add_rms_norm_linear"):
        other = GpuFusedKernels(tmp_path)
        assert other.fall_back(kernel) and not other.gemv


@pytest.mark.parametrize("how", ["raises", "nan", "wrong"])
def test_mojo_refuses_a_failing_kernel(how: str) -> None:
    with pytest.raises(KernelBuildError, match=r"attention\.decode"):
        select_kernels(
            "mojo", "cpu", DEMO, load=_loader({ATTENTION: Broken(ATTENTION, how, "decode")})
        )


def test_passing_kernels_are_kept() -> None:
    kernels = select_kernels("mojo", "cpu", DEMO)
    assert (kernels.attention.name, kernels.fused_ops.name, kernels.faults) == ("mojo", "mojo", ())
    torch_only = select_kernels("torch", "cpu", DEMO)
    assert isinstance(torch_only.attention, TorchAttention)
    assert isinstance(torch_only.fused_ops, TorchFusedOps)


def test_unsupported_dtype_falls_back_or_refuses() -> None:
    odd = CheckShape(8, 4, 64, 16, "float64")
    kernels = select_kernels("auto", "cpu", odd)
    assert (kernels.attention.name, kernels.fused_ops.name) == ("torch", "torch")
    with pytest.raises(KernelBuildError, match="float64"):
        select_kernels("mojo", "cpu", odd)


def test_the_isolated_check_passes_the_real_kernels() -> None:
    # The path CUDA takes, on the CPU kernels: a child process loads and checks them.
    assert check_isolated(DEMO, "cpu", [ATTENTION, FUSED]) == []


def test_a_child_that_crashes_fails_every_family_it_checked() -> None:
    # A segfault, as an illegal address in a kernel would end a process.
    crash = [sys.executable, "-c", "import ctypes; ctypes.string_at(0)"]
    faults = run_child(crash, [ATTENTION, FUSED], timeout_s=60)
    assert [f.family for f in faults] == [ATTENTION, FUSED]
    assert all("killed by signal 11" in f.error for f in faults), faults


def test_a_child_that_hangs_or_says_nothing_fails() -> None:
    hang = [sys.executable, "-c", "import time; time.sleep(30)"]
    faults = run_child(hang, [ATTENTION], timeout_s=1)
    assert len(faults) == 1 and "took over 1 s" in faults[0].error
    silent = [sys.executable, "-c", "import sys; sys.stderr.write('no PTX\\n'); sys.exit(3)"]
    faults = run_child(silent, [FUSED], timeout_s=60)
    assert len(faults) == 1 and "exited with status 3: no PTX" in faults[0].error


# ---- services: what they run, and what Info says -------------------------------------------


def _decode_info(server: DecodeServerThread) -> decode_pb2.InfoResponse:
    async def call() -> decode_pb2.InfoResponse:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            return await stub.Info(decode_pb2.InfoRequest())

    return server.run(call())


def test_decode_info_reports_the_kernels_really_used(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    config = DecodeConfig(
        model_dir=demo_model_dir, engine=EngineConfig(block_size=16, num_blocks=32)
    )
    server = DecodeServerThread(config)
    try:
        info = _decode_info(server)
    finally:
        server.close()
    assert (info.attention_backend, info.fused_ops) == ("mojo", "mojo")

    broken = {ATTENTION: Broken(ATTENTION, "nan", "prefill")}
    monkeypatch.setattr("kernels.choice.load_family", _loader(broken))
    with caplog.at_level(logging.WARNING, logger="mili.kernels"):
        server = DecodeServerThread(config)
    try:
        info = _decode_info(server)
    finally:
        server.close()
    assert (info.attention_backend, info.fused_ops) == ("torch", "mojo")
    assert "attention.prefill" in caplog.text


def test_prefill_refuses_to_start_on_a_failing_kernel_with_mojo(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        "kernels.choice.load_family", _loader({FUSED: Broken(FUSED, "raises", "rms_norm")})
    )
    engine = EngineConfig(block_size=16, num_blocks=32, attention="mojo")
    with pytest.raises(Exception, match=r"--attention mojo: .*fused\.rms_norm") as failure:
        PrefillInstance.load(PrefillConfig(engine=engine), demo_model_dir)
    assert type(failure.value).__name__ == "StartupError"
    auto = PrefillInstance.load(
        PrefillConfig(engine=EngineConfig(block_size=16, num_blocks=32)), demo_model_dir
    )
    assert (auto.attention_backend, auto.fused_ops) == ("mojo", "torch")
