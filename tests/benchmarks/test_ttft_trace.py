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
    p50 = {label: float(median) for label, median, _ in rows}
    # reserve, prefill, compute, commit, first token; the compute's start and the KV stream's
    # opening race (the worker's thread against the event loop), so each is only held between
    # the prompt's arrival and decode's commit
    racing = ["prefill compute starts", "prefill opens the KV transfer"]
    chain = [p50[label] for label in p50 if label not in racing]
    assert chain == sorted(chain), run.stdout
    for label in racing:
        assert p50["prefill has the prompt"] <= p50[label] <= p50["decode has the KV (commit)"]
    assert chain[0] > 0 and chain[-1] < 5000
