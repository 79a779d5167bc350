"""Single-process generate() throughput on CPU: the baseline the services are measured against.

Rows: the embedded demo model and a random-weight Qwen3-0.6B (preset "qwen3-0.6b", written once
as a bf16 checkpoint into --cache-dir and reused), in fp32 and bf16, with each attention backend
(torch reference, Mojo kernels), at each batch size; greedy, EOS ignored, so every request makes
exactly --output-len tokens.

Each (model, dtype, attention) group runs in a fresh process so its peak RSS (getrusage
ru_maxrss) is its own, not the maximum over everything measured before it.

    .venv/bin/python benchmarks/generate_cpu.py --threads 2
    .venv/bin/python benchmarks/generate_cpu.py --models demo --batch 1 --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mili.engine.generate import GenerationStats, generate
from mili.engine.model.checkpoint import cached_random_checkpoint
from mili.engine.model.config import PRESETS
from mili.engine.model.loader import load_model
from mili.engine.sampling_params import SamplingParams

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Row:
    model: str
    dtype: str
    attention: str  # backend: torch (reference) or mojo (kernels/)
    batch: int
    prompt_len: int
    output_len: int
    prefill_tok_s: float  # prompt tokens / prefill wall time
    decode_tok_s: float  # tokens from decode steps / decode wall time
    e2e_out_tok_s: float  # output tokens / (prefill + decode)
    total_s: float
    peak_rss_gib: float  # of the process that ran this (model, dtype) group
    load1: float  # 1-minute load average when the row started (others' work on a shared host)


def checkpoint_dir(model: str, cache_dir: Path) -> Path:
    """The demo model, or a random-weight bf16 preset written once into `cache_dir`."""
    if model == "demo":
        from mili.demo.model import default_model_dir

        return default_model_dir()
    return cached_random_checkpoint(PRESETS[model], model, cache_dir)


def run_group(
    path: Path, model_name: str, dtype_name: str, attention: str, args: argparse.Namespace
) -> list[Row]:
    """All batch sizes of one (model, dtype, attention) in this (fresh) process."""
    from kernels.backend import select_attention

    torch.set_num_threads(args.threads)
    model = load_model(path, dtype=DTYPES[dtype_name])
    model.attention = select_attention(attention, "cpu", head_dim=model.config.head_dim)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    # Warm-up: first calls allocate and pick kernels; keep them out of the numbers.
    generate(model, [[1] * 16], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    rows = []
    for batch in args.batch:
        output_len = args.override.get(f"{model_name}/{dtype_name}/{batch}", args.output_len)
        prompts = [
            torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(batch)
        ]
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        load1 = os.getloadavg()[0]
        # Best of --repeats: on a shared machine the fastest run is the least disturbed one.
        runs = []
        for _ in range(args.repeats):
            stats = GenerationStats()
            results = generate(model, prompts, params, stats=stats)
            assert all(len(r.token_ids) == output_len for r in results)
            runs.append(stats)
        stats = min(runs, key=lambda st: st.prefill_s + st.decode_s)
        total = stats.prefill_s + stats.decode_s
        rows.append(
            Row(
                model=model_name,
                dtype=dtype_name,
                attention=attention,
                batch=batch,
                prompt_len=args.prompt_len,
                output_len=output_len,
                prefill_tok_s=stats.num_prefill_tokens / stats.prefill_s,
                decode_tok_s=stats.num_decode_tokens / stats.decode_s if stats.decode_s else 0.0,
                e2e_out_tok_s=batch * output_len / total,
                total_s=total,
                peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                load1=load1,
            )
        )
        print(_format([rows[-1]], header=False), file=sys.stderr, flush=True)
    return rows


def _format(rows: list[Row], header: bool = True) -> str:
    names = "model dtype attention batch prompt output prefill_tok/s decode_tok/s"
    names += " e2e_out_tok/s total_s rss_GiB load1"
    cols = names.split()
    lines = [f"| {' | '.join(cols)} |", "|" + " --- |" * len(cols)] if header else []
    for r in rows:
        cells = [
            r.model,
            r.dtype,
            r.attention,
            str(r.batch),
            str(r.prompt_len),
            str(r.output_len),
            f"{r.prefill_tok_s:.1f}",
            f"{r.decode_tok_s:.1f}",
            f"{r.e2e_out_tok_s:.1f}",
            f"{r.total_s:.1f}",
            f"{r.peak_rss_gib:.2f}",
            f"{r.load1:.1f}",
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="demo,qwen3-0.6b", help="comma list: demo, presets")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    parser.add_argument(
        "--attention", default="torch,mojo", help="comma list of attention backends: torch, mojo"
    )
    parser.add_argument("--batch", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=1, help="runs per row; the best is shown")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="MODEL/DTYPE/BATCH=N",
        help="output length N for one row that would run too long, e.g. qwen3-0.6b/fp32/16=32",
    )
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/mili/bench")
    parser.add_argument("--json", action="store_true", help="print rows as JSON, not a table")
    args = parser.parse_args()
    args.override = {k: int(v) for k, v in (o.split("=") for o in args.override)}

    torch.set_num_threads(args.threads)
    # The machine may be shared: the load average says whether the numbers are trustworthy.
    load_before = os.getloadavg()
    rows: list[Row] = []
    spawn = multiprocessing.get_context("spawn")
    for model_name in args.models.split(","):
        path = checkpoint_dir(model_name, args.cache_dir)
        for dtype_name in args.dtypes.split(","):
            for attention in args.attention.split(","):
                with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                    group = pool.submit(run_group, path, model_name, dtype_name, attention, args)
                    rows += group.result()
    load = {"loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "threads": args.threads, **load}))
    else:
        print(_format(rows))
        print(f"threads={args.threads}  " + "  ".join(f"{k}={v}" for k, v in load.items()))


if __name__ == "__main__":
    main()
