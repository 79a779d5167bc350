"""`--attention` selection, and the Mojo backend driving the real Qwen3 model."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from kernels import build
from kernels.backend import select_attention
from kernels.cpu import CpuKernels
from mili.engine.generate import generate
from mili.engine.model.attention import TorchAttention
from mili.engine.model.loader import load_model
from mili.engine.sampling_params import SamplingParams


def _break_toolchain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process see no Mojo compiler, as on a machine without the toolchain."""
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))


def test_torch_choice_is_the_reference() -> None:
    assert isinstance(select_attention("torch", "cpu", head_dim=128), TorchAttention)


def test_mojo_is_the_default_where_it_builds() -> None:
    from mili.engine.engine_config import DEFAULT_ATTENTION

    assert DEFAULT_ATTENTION == "auto"
    backend = select_attention("auto", "cpu", head_dim=64)
    assert isinstance(backend, CpuKernels) and backend.name == "mojo"


def test_auto_falls_back_to_torch_and_says_why(tmp_path, monkeypatch, caplog) -> None:
    _break_toolchain(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="mili.kernels"):
        backend = select_attention("auto", "cpu", head_dim=64, root=tmp_path)
    assert isinstance(backend, TorchAttention)
    assert "Mojo toolchain not found" in caplog.text


def test_a_damaged_cache_entry_falls_back_under_auto(tmp_path, caplog) -> None:
    """A cached module cut short (a full disk, a copied cache): ImportError once took the
    service down under auto; now torch runs it, the log says which file, and mojo refuses."""
    from mili.cache import cache_root

    built = build.build_cpu()  # this source's module, built once for the suite
    damaged = tmp_path / built.relative_to(cache_root())
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="mili.kernels"):
        backend = select_attention("auto", "cpu", head_dim=64, root=tmp_path)
    assert isinstance(backend, TorchAttention)
    assert "remove that cache entry to rebuild" in caplog.text
    with pytest.raises(build.KernelBuildError, match="cannot load the Mojo attention kernels"):
        select_attention("mojo", "cpu", head_dim=64, root=tmp_path)


def test_explicit_mojo_without_toolchain_fails(tmp_path, monkeypatch) -> None:
    _break_toolchain(tmp_path, monkeypatch)
    with pytest.raises(build.KernelBuildError, match="Mojo toolchain not found"):
        select_attention("mojo", "cpu", head_dim=64, root=tmp_path)


def test_unsupported_head_dim(caplog) -> None:
    with pytest.raises(build.KernelBuildError, match="this model has 32"):
        select_attention("mojo", "cpu", head_dim=32)
    with caplog.at_level(logging.WARNING, logger="mili.kernels"):
        assert isinstance(select_attention("auto", "cpu", head_dim=32), TorchAttention)
    assert "head_dim 64, 128, 256" in caplog.text


def test_unknown_choice() -> None:
    with pytest.raises(ValueError, match="--attention must be one of auto, mojo, torch"):
        select_attention("flash", "cpu", head_dim=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_demo_model_generates_the_same_with_mojo_and_torch(demo_model_dir: Path, dtype) -> None:
    # Whole-model check: prefill of a packed batch with chunking, then paged decode steps, on
    # the demo checkpoint (head_dim 64, 8/4 heads). Greedy tokens must match; fp32 exactly.
    prompts = [[5, 9, 33, 2, 17] * 7, [101, 7], list(range(40, 90))]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outputs = {}
    for backend in (TorchAttention(), select_attention("mojo", "cpu", head_dim=64)):
        model = load_model(demo_model_dir, dtype=dtype, attention=backend)
        results = generate(model, prompts, params, prefill_chunk_size=16)
        outputs[backend.name] = [r.token_ids for r in results]
    if dtype == torch.float32:
        assert outputs["mojo"] == outputs["torch"]
    else:  # bf16 near-ties may flip late tokens; the first ones must agree
        for mojo, ref in zip(outputs["mojo"], outputs["torch"], strict=True):
            assert mojo[:4] == ref[:4]


@pytest.mark.parametrize(
    ("family", "arch_dir"), [("attention", "sm_90"), ("fused-op", "sm_90-fused")]
)
def test_missing_or_stale_ptx_is_reported_by_name(
    tmp_path, monkeypatch, family: str, arch_dir: str
) -> None:
    # A GPU host without the toolchain whose cache holds PTX of an older kernel source only.
    from kernels.backend import select_fused_ops

    _break_toolchain(tmp_path, monkeypatch)
    (tmp_path / "kernels" / "0123456789abcdef" / arch_dir).mkdir(parents=True)
    (tmp_path / "kernels" / "0123456789abcdef" / arch_dir / "manifest.json").write_text("{}")
    select = select_attention if family == "attention" else select_fused_ops
    with pytest.raises(build.KernelBuildError) as failure:
        select("mojo", "cuda", head_dim=64, root=tmp_path)
    message = str(failure.value)
    assert f"no {family} PTX for this kernel source at {tmp_path}/kernels/" in message
    assert f"stale {arch_dir} PTX of other kernel sources is there (0123456789abcdef)" in message
    assert "Mojo toolchain not found" in message
