"""benchmarks/gpu_check.sh end to end on the CPU (`--device cpu`: the GPU plan with tiny shapes and
short caps): every piece runs and passes, the logs stay within the GPU host's 8 files, and each
holds the rows its piece measured.

The GPU plan itself only runs on a GPU host; this proves the script around it (plan, caps, logs)
and the CPU paths of every benchmark it calls. About a minute on two cores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOGS = {
    "run.log",
    "env.txt",
    "kernels.log",
    "tests.log",
    "engine.log",
    "attention.log",
    "serve.log",
    "kv.log",
}
NUMBER = r"[0-9][0-9.e+-]*"


@pytest.fixture(scope="module")
def check_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the CPU check once; its $OUT."""
    tmp = tmp_path_factory.mktemp("gpu-check")
    out = tmp / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "BENCH_CACHE": str(tmp / "bench-cache"),  # the tiny checkpoint, written by the check
    }
    result = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--device", "cpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.iterdir()))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{logs}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_every_piece_runs_and_passes_within_eight_files(check_out: Path) -> None:
    assert {p.name for p in check_out.iterdir()} == LOGS  # the GPU host hands back 8 files
    run_log = (check_out / "run.log").read_text()
    started = re.findall(r"\] START cap \d+s: (.*)", run_log)
    ended = {command: rc for rc, command in re.findall(r"\] END exit (\d+)[^:]*: (.*)", run_log)}
    # env, checkpoint, 3 kernel pieces, 3 test pieces, 17 in phase B
    assert len(started) == 25, run_log
    assert {command: ended.get(command) for command in started} == dict.fromkeys(started, "0")
    assert "SKIP" not in run_log
    assert "0 failed, 0 skipped" in run_log.splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_each_log_holds_measured_rows(check_out: Path) -> None:
    def log(name: str) -> str:
        return (check_out / name).read_text()

    assert "# 0 problems" in log("env.txt")
    kernels = log("kernels.log")
    assert "ok prefill" in kernels and "# 0 failed" in kernels
    assert re.search(r"\b521 passed", kernels)  # the CPU parity grid, one process
    assert re.search(r"\b411 passed", kernels)  # the fused ops'
    tests = log("tests.log")
    assert re.search(r"\d+ passed, \d+ skipped", tests)
    # the paths added since the plan was made: their GPU tests collected (and skipped here)
    assert "test_mask_gpu.py::test_cuda_torch_path_equals_cpu_numpy_path" in tests
    assert "test_moe.py::test_cuda_grouped_mm_matches_reference_and_captures SKIPPED" in tests

    engine = log("engine.log")
    # parity: the prefill and one line per teacher-forced decode step, then the verdict
    steps = re.findall(rf"^decode (\d+) +max\|diff\|/max\|ref\| ({NUMBER})", engine, re.M)
    assert [int(step) for step, _ in steps] == [0, 1, 2, 3] * 2  # 6 rows on a GPU, then 3
    assert all(float(rel) < 1e-3 for _, rel in steps)  # fp32 on both sides
    assert re.search(r"^prefill +max\|diff\|", engine, re.M) and "# verdict: ok" in engine
    # speed: a TPOT and tok/s per batch as each finished, then the table and its JSON
    for batch in (1, 8):
        assert re.search(rf"^eager +batch +{batch}: TPOT +{NUMBER} ms, +\d+ tok/s", engine, re.M)
        # decode's overlapped steps (the next forward launched before the last ids are in),
        # after decode's start-up check of them
        assert re.search(rf"^ahead +batch +{batch}: TPOT +{NUMBER} ms, +\d+ tok/s", engine, re.M)
    assert "ahead: start-up check passed" in engine
    # the same steps with overlapped launches (on the CPU no kernel family takes them)
    assert re.search(r"^# .*, overlapped launches \(0 kernel families\), ", engine, re.M)
    assert '"prefill_tokens_per_s"' in engine
    # MoE, random weights made on the device (no checkpoint): a row per batch, then the JSON
    moe_header = r"^# tiny-moe .* 8 experts \(2 active, grouped_mm\), weights random"
    assert re.search(moe_header, engine, re.M)
    assert re.search(rf"^eager +batch +10: TPOT +{NUMBER} ms", engine, re.M)
    assert '"random_on_device": "True"' in engine
    # the sampler's time per kind of row, and the whole-row scan beside it
    for kind in ("random", "top-p", "qwen3", "greedy", "blocks", "scan"):
        assert re.search(rf"^batch +4 {kind} *: device +{NUMBER} ms", engine, re.M), kind
    # the JSON-constrained decode step against the unconstrained one, a row per model
    row = rf"^\| demo \(cpu, \d+ mask threads?\) \| 4 \| 3 \| {NUMBER} \| {NUMBER} \| {NUMBER}x \|"
    assert re.search(row, engine, re.M)
    # and each mode's step cut into its phases, the masks' fill among the constrained ones
    for mode in ("sync", "overlapped"):
        for arm in ("free", "json"):
            phases = rf"^  phases {mode} +{arm}: step median {NUMBER} mean {NUMBER} max {NUMBER} ms"
            assert re.search(phases, engine, re.M), (mode, arm)
    assert re.search(rf"^  phases overlapped json: .*, fill {NUMBER},", engine, re.M)

    attention = log("attention.log")
    assert re.search(rf"^ +128( +{NUMBER}){{6}}$", attention, re.M)  # prefill T=128 vs SDPA
    assert re.search(r"^ +4 +256 ", attention, re.M)  # decode 4 x 256
    # the small-batch GEMVs: a row per projection and batch, then the step's sums
    assert re.search(rf"^ +qkv +\d+x\d+ +1 +{NUMBER}us", attention, re.M)
    assert re.search(r"^step's GEMVs at batch 8 \(2 layers \+ head\): linear", attention, re.M)
    assert re.search(r"^silu_mul +fp32 +16 ", attention, re.M)  # fused ops
    assert re.search(r"^decode step fp32 B=1 ", attention, re.M)

    serve = log("serve.log")
    for level in (1, 4):
        row = rf"^concurrency {level} +TTFT p50 +{NUMBER} .* +\d+ output tok/s   client .*% CPU$"
        assert re.search(row, serve, re.M), serve
    assert '"output_tokens_per_s"' in serve
    # each `mili serve` piece says what its services ran (--attention auto: Mojo where the
    # self-check passed, torch where a kernel failed it)
    kernels = re.findall(
        r"^kernels: decode-0 attention (\w+), .*; prefill-0 attention (\w+)", serve, re.M
    )
    assert kernels == [("mojo", "mojo")] * 4, serve
    # concurrency 1 again, decode's steps not overlapped, for the side-by-side; and the
    # saturated level again with one frontend, then over two with prefill steps of 4096 tokens
    assert len(re.findall(r"^concurrency 1 +TTFT p50 ", serve, re.M)) == 2, serve
    assert len(re.findall(r"^concurrency 4 +TTFT p50 ", serve, re.M)) == 3, serve
    assert len(re.findall(r"CPU % .*frontend-0 \d+, frontend-1 \d+", serve)) == 1, serve
    # the throughput levels' clients in 4 processes (a level of 4 clients: one each), the
    # TTFT runs' one client in one
    assert len(re.findall(r"^concurrency 4 .* client 4 x <= \d+% CPU$", serve, re.M)) == 3
    assert len(re.findall(r"^concurrency 1 .* client 1 x <= \d+% CPU$", serve, re.M)) == 2
    assert "prefill --max-batch-tokens: 4096" in serve, serve
    # one request's TTFT milestone by milestone (ttft_trace.py), every one found
    assert "3 requests, 512-token prompts, 2 out, concurrency 1, cpu, tiny" in serve, serve
    assert "8 requests, 512-token prompts, 8 out, concurrency 4, cpu, tiny" in serve, serve
    firsts = re.findall(rf"^frontend has the first token +{NUMBER} +{NUMBER}$", serve, re.M)
    assert len(firsts) == 2, serve

    kv = log("kv.log")
    assert re.search(rf"^decode +{NUMBER} +{NUMBER} +{NUMBER} .* grpc$", kv, re.M), kv
    assert re.search(rf"^decode-shm +{NUMBER} +{NUMBER} +{NUMBER} .* shm$", kv, re.M), kv
