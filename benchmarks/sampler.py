"""The sampler's device time per decode step (issue 33: "the sampler and the copies around the
step"), on a Qwen3-sized vocabulary (151,669 tokenizer ids in 151,936 logit columns).

For each batch and kind of row, `Sampler.launch` then its `.result()` on random float32 logits:

    random    temperature 1 (the OpenAI default): softmax, then the inverse-CDF draw
    top-p     temperature 0.7, top-p 0.95: one sort of each row for the filter, then the draw
    qwen3     temperature 0.6, top-k 20, top-p 0.95 (Qwen3's recommended sampling): the filter
              read off each row's 20 largest logits (torch.topk), then the draw
    greedy    temperature 0: argmax alone

On CUDA "device" is the stream's time from before the launch to after it (CUDA events), the
host's launch time beside it; on the CPU both are the call's wall time. Then the inverse-CDF
draw alone both ways on the same probabilities: `blocks`, the two levels the sampler takes
(block sums pick the block), and `scan`, one float64 running sum over whole rows and a search
(what it took until 2026-11-27, and still takes for a single CUDA row: torch's scan of one row
is CUB's; of several, each row's tiles one after another on one CTA).

    python3 benchmarks/sampler.py --device cuda                     # GPU host, ~10 s
    .venv/bin/python benchmarks/sampler.py --device cpu --batches 1,64 --repeats 3
    .venv/bin/python benchmarks/sampler.py --device cpu --batches 64 --vocab 64 --repeats 200
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mili.engine.sampling_params import SamplingParams
from mili.engine.step.distribution import inverse_cdf_in_blocks, inverse_cdf_whole_rows
from mili.engine.step.sampler import Sampler, SequenceSampling

VOCAB = 151_669  # Qwen3's tokenizer ids
COLUMNS = 151_936  # its logit rows
KINDS = {
    "random": SamplingParams(temperature=1.0),
    "top-p": SamplingParams(temperature=0.7, top_p=0.95),
    "qwen3": SamplingParams(temperature=0.6, top_k=20, top_p=0.95),  # its recommended sampling
    "greedy": SamplingParams(temperature=0.0),
}


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """(device ms, host launch ms), medians over `repeats` calls after one warm-up."""
    cuda = device.type == "cuda"
    fn()
    device_ms, host_ms = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        t0 = time.perf_counter()
        fn()
        host_ms.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end.record()
            end.synchronize()
            device_ms.append(begin.elapsed_time(end))
    return statistics.median(device_ms or host_ms), statistics.median(host_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,64,256", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--vocab",
        type=int,
        default=VOCAB,
        help="tokenizer ids (Qwen3's by default; a small one, 64 say, leaves the ops nothing to "
        "do: the launch column is then what dispatching them costs)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    vocab = args.vocab
    columns = COLUMNS if vocab == VOCAB else vocab
    sampler = Sampler(vocab)
    print(f"sampler on {device}, vocabulary {vocab} of {columns} columns, float32 logits")
    for batch in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(batch, columns, device=device) * 3
        for kind, params in KINDS.items():
            seqs = [SequenceSampling(params, [1, 2, 3], vocab) for _ in range(batch)]
            device_ms, host_ms = timed(
                functools.partial(draw, sampler, logits, seqs), device, args.repeats
            )
            print(
                f"batch {batch:4} {kind:7}: device {device_ms:7.3f} ms, launch {host_ms:6.3f} ms",
                flush=True,
            )
        probs = logits[:, :vocab].softmax(-1)
        u = torch.rand(batch, dtype=torch.float64, device=device)
        for name, draw_fn in (("blocks", inverse_cdf_in_blocks), ("scan", inverse_cdf_whole_rows)):
            device_ms, host_ms = timed(functools.partial(draw_fn, probs, u), device, args.repeats)
            print(
                f"batch {batch:4} {name:7}: device {device_ms:7.3f} ms, launch {host_ms:6.3f} ms",
                flush=True,
            )


def draw(sampler: Sampler, logits: torch.Tensor, seqs: list[SequenceSampling]) -> None:
    with torch.inference_mode():
        sampler.launch(logits, seqs).result()


if __name__ == "__main__":
    main()
