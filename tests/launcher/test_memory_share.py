"""`mili serve --device cuda`: each prefill and decode process gets its share of the GPU."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mili.errors import StartupError
from mili.serve.launcher import add_arguments
from mili.serve.plan import make_plan, memory_shares


def plan_for(tmp_path: Path, *argv: str) -> tuple[list[list[str]], list[list[str]]]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--decode-port", "1", *argv])  # a fixed port: no port probing
    plan = make_plan(args, tmp_path)
    return plan.prefills, plan.decodes


def utilization(argv: list[str]) -> float:
    return float(argv[argv.index("--gpu-memory-utilization") + 1])


def test_shares_split_the_utilization() -> None:
    assert memory_shares(0.9, 0.2, 1, 1) == pytest.approx((0.18, 0.72))
    assert memory_shares(0.8, 0.25, 2, 3) == pytest.approx((0.1, 0.2))
    with pytest.raises(StartupError, match="--prefill-memory-share"):
        memory_shares(0.9, 1.0, 1, 1)
    with pytest.raises(StartupError, match="--gpu-memory-utilization"):
        memory_shares(1.5, 0.2, 1, 1)


def test_cuda_children_get_their_share_and_extra_args_still_win(tmp_path: Path) -> None:
    prefills, decodes = plan_for(
        tmp_path, "--device", "cuda", "--prefill-instances", "2", "--decode-args",
        "--num-blocks 4096",
    )  # fmt: skip
    assert [utilization(a) for a in prefills] == [0.09, 0.09]
    assert [utilization(a) for a in decodes] == [0.72]
    # The child's parser takes the last occurrence: --decode-args come after the share.
    assert decodes[0].index("--num-blocks") > decodes[0].index("--gpu-memory-utilization")
    # CPU: no device memory to share.
    prefills, decodes = plan_for(tmp_path)
    assert not any("--gpu-memory-utilization" in a for a in (*prefills, *decodes))
