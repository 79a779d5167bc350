"""The sampler's cost for a batch with penalties (repetition/presence/frequency), per source tree.

Every step the sampler turns each penalised row's prompt ids and output ids into an index on the
device (counts per token). That work is the host's, between one step's ids coming back and the
next sampling's launch, so with decode's overlapped steps it is not hidden by the device. This
times that bookkeeping alone (the sampler's `_counts` for the prompts and the outputs, over a
stand-in for the logits on torch's meta device, so no tensor work runs) for a batch of
Qwen3-vocabulary rows, for each `--tree` (a source tree; e.g. a `git worktree` of an older
commit), rounds alternating the trees in subprocesses, medians printed.

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/penalties.py --tree ../old --tree .
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = """
import json, random, sys, time
import torch
from mili.engine.step import sampler
batch, prompt, output, vocab, steps = (int(a) for a in sys.argv[1:6])
rng = random.Random(0)
params = sampler.SamplingParams(temperature=0, repetition_penalty=1.1, presence_penalty=0.5)
rows = []
for _ in range(batch):
    row = sampler.SequenceSampling(params, [rng.randrange(vocab) for _ in range(prompt)], vocab)
    for _ in range(output):
        row.append(rng.randrange(vocab))
    rows.append(row)
# The logits' stand-in on the meta device: shapes only, so what is timed is the host's work.
like = torch.empty(batch, vocab, device="meta")
def outputs(row):  # what each tree's sampler hands `_counts` for a row's output ids
    return row.output_id_array() if hasattr(row, "output_id_array") else row.output_token_ids
times = []
for _ in range(steps + 1):
    start = time.perf_counter()
    sampler._counts({i: r.prompt_token_ids for i, r in enumerate(rows)}, like)
    sampler._counts({i: outputs(r) for i, r in enumerate(rows)}, like)
    times.append(time.perf_counter() - start)
times = sorted(times[1:])
print(json.dumps({"host": times[len(times) // 2] * 1e3}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True, help="source tree (repeatable)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, action="append", help="prompt tokens (repeatable)")
    parser.add_argument("--output", type=int, default=256, help="output tokens so far per row")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prompts = args.prompt or [512, 2048]
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for prompt in prompts:
            for tree in args.tree:
                cmd = [sys.executable, "-c", _CHILD, str(args.batch), str(prompt),
                       str(args.output), str(args.vocab), str(args.steps)]  # fmt: skip
                env = {"PYTHONPATH": str(Path(tree).resolve()), "PATH": "/usr/bin:/bin"}
                # cwd too: `python -c` puts the working directory first on sys.path
                got = json.loads(subprocess.run(cmd, env=env, cwd=tree, check=True,
                                                capture_output=True, text=True).stdout)  # fmt: skip
                results.setdefault((tree, prompt), []).append(got["host"])
    print(f"batch {args.batch}, vocab {args.vocab}, {args.output} output ids a row, "
          f"medians of {args.rounds} rounds x {args.steps} steps")  # fmt: skip
    print("| tree | prompt tokens | host ms a step |")
    print("| --- | --- | --- |")
    for (tree, prompt), times in results.items():
        print(f"| {tree} | {prompt} | {statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
