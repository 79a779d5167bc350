"""What the attention backend is worth to the whole model: decode tokens/s with torch vs Mojo.

One process, one loaded model; the backends take turns (--rounds rounds of torch, mojo, each a
full `generate()` of --batch prompts of --prompt-len random ids and --output-len greedy tokens),
so the machine's drift and neighbours hit all of them alike — separate processes (as
generate_cpu.py runs them, for clean peak RSS) differ by more than the effect on a shared VM.
Reported per backend: best and all rounds' decode tokens/s, and mojo / torch of the bests.

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/attention_e2e.py --dtype bf16 --batch 16
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generate_cpu import DTYPES, checkpoint_dir
from kernels.backend import select_attention
from mili.engine.generate import GenerationStats, generate
from mili.engine.model.attention import AttentionBackend, TorchAttention
from mili.engine.model.loader import load_model
from mili.engine.sampling_params import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="demo or a preset name")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/mili/bench")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = load_model(checkpoint_dir(args.model, args.cache_dir), dtype=DTYPES[args.dtype])
    backends: dict[str, AttentionBackend] = {
        "torch": TorchAttention(),
        "mojo": select_attention("mojo", "cpu", head_dim=model.config.head_dim),
    }
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [
        torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    print(f"{args.model} {args.dtype} batch {args.batch}, load average {os.getloadavg()[0]:.2f}")
    rates: dict[str, list[float]] = {name: [] for name in backends}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, backend in backends.items():
            model.attention = backend
            stats = GenerationStats()
            results = generate(model, prompts, params, stats=stats)
            outputs[name] = [r.token_ids for r in results]
            rates[name].append(stats.num_decode_tokens / stats.decode_s)
    for name, values in rates.items():
        shown = ", ".join(f"{v:.1f}" for v in values)
        print(f"  {name:6} decode {max(values):8.1f} tok/s best  ({shown})")
    speedup = max(rates["mojo"]) / max(rates["torch"])
    same = sum(a == b for a, b in zip(outputs["mojo"], outputs["torch"], strict=True))
    print(f"  mojo / torch {speedup:.2f}x; greedy outputs identical for {same}/{args.batch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
