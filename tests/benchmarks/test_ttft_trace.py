"""benchmarks/ttft_trace.py on the tiny preset: every milestone of every request is found in the
services' spans, and they come in the pipeline's order."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_every_milestone_in_the_pipelines_order(tmp_path: Path) -> None:
    command = ["benchmarks/ttft_trace.py", "--device", "cpu", "--preset", "tiny", "--requests"]
    run = subprocess.run(
        [sys.executable, *command, "3", "--warmup", "1", "--cache-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("3 requests, 512-token prompts"), run.stdout
    rows = re.findall(r"^(\w[\w ()-]+?) +([\d.]+) +([\d.]+)$", run.stdout, re.M)
    assert len(rows) == 10, run.stdout  # every milestone found
    p50 = [float(median) for _, median, _ in rows]
    assert p50 == sorted(p50), run.stdout  # reserve, prefill, compute, commit, first token
    assert p50[0] > 0 and p50[-1] < 5000
