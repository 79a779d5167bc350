"""The sampler's device time per decode step (issue 33: "the sampler and the copies around the
step"), on a Qwen3-sized vocabulary (151,669 tokenizer ids in 151,936 logit columns).

For each batch and kind of row, `Sampler.launch` then its `.result()` on random float32 logits:

    random    temperature 1 (the OpenAI default): softmax, then the inverse-CDF draw
    top-p     temperature 0.7, top-p 0.95: one sort of each row for the filter, then the draw
    qwen3     temperature 0.6, top-k 20, top-p 0.95 (Qwen3's recommended sampling): the filter
              read off each row's 20 largest logits (torch.topk), then the draw
    greedy    temperature 0: argmax alone
    masked    temperature 1 under a constraint's mask on every row (a random quarter of the
              ids allowed, in pinned int32 words as decode's masker hands them over)

On CUDA each kind is timed twice: launched eagerly, then as decode's graph steps launch it,
replayed from a CUDA graph (`+graph`: mili/engine/step/sampler_graphs.py, over a static logits
buffer like the decode graphs'; two launches first, the eager one and the capture). "device"
is the stream's time from before the launch to after it (CUDA events), the host's launch time
beside it; on the CPU both are the call's wall time. Then the inverse-CDF
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

from mili.engine.constraint.mask import FilledMask
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.distribution import inverse_cdf_in_blocks, inverse_cdf_whole_rows
from mili.engine.step.sampler import PendingSample, Sampler, SequenceSampling
from mili.engine.step.sampler_graphs import SamplerGraphs

VOCAB = 151_669  # Qwen3's tokenizer ids
COLUMNS = 151_936  # its logit rows
KINDS = {
    "random": SamplingParams(temperature=1.0),
    "top-p": SamplingParams(temperature=0.7, top_p=0.95),
    "qwen3": SamplingParams(temperature=0.6, top_k=20, top_p=0.95),  # its recommended sampling
    "greedy": SamplingParams(temperature=0.0),
    "masked": SamplingParams(temperature=1.0),
}


def timed(
    fn: Callable[[], object], device: torch.device, repeats: int, warm_up: int = 1
) -> tuple[float, float]:
    """(device ms, host launch ms), medians over `repeats` calls after `warm_up` calls."""
    cuda = device.type == "cuda"
    for _ in range(warm_up):
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
    batches = [int(b) for b in args.batches.split(",")]
    cuda = device.type == "cuda"
    # The decode graphs' static logits, and a sampler graph per batch and kind over them
    static = torch.empty(max(batches), columns, device=device) if cuda else None
    graphs = SamplerGraphs(sampler, static, tuple(sorted(batches))) if static is not None else None
    words = (columns + 31) // 32
    mask_buffer = torch.zeros((max(batches), words), dtype=torch.int32, pin_memory=cuda)
    print(f"sampler on {device}, vocabulary {vocab} of {columns} columns, float32 logits")
    for batch in batches:
        logits = torch.randn(batch, columns, device=device) * 3
        bits = torch.randint(-(2**31), 2**31, (2, batch, words), dtype=torch.int64)
        mask_buffer[:batch] = (bits[0] & bits[1]).int()  # a quarter of the bits set
        mask = FilledMask(mask_buffer[:batch], list(range(batch)))
        for kind, params in KINDS.items():
            seqs = [SequenceSampling(params, [1, 2, 3], vocab) for _ in range(batch)]
            masked = mask if kind == "masked" else None
            # a mask is applied in place: on a copy, so the draws below see dense rows
            rows = logits.clone() if masked is not None else logits
            runs = [(kind, functools.partial(draw, sampler.launch, rows, seqs, masked), 1)]
            if graphs is not None and static is not None:
                static[:batch] = logits
                launch = functools.partial(draw, graphs.launch, static[:batch], seqs, masked)
                runs.append((f"{kind}+graph", launch, 2))
            for name, fn, warm_up in runs:
                device_ms, host_ms = timed(fn, device, args.repeats, warm_up)
                print(
                    f"batch {batch:4} {name:12}: device {device_ms:7.3f} ms, "
                    f"launch {host_ms:6.3f} ms",
                    flush=True,
                )
        if graphs is not None:
            print(f"batch {batch:4} sampler graphs: {graphs.num_graphs}, "
                  f"replays {graphs.num_replays}", flush=True)  # fmt: skip
        probs = logits[:, :vocab].softmax(-1)
        u = torch.rand(batch, dtype=torch.float64, device=device)
        for name, draw_fn in (("blocks", inverse_cdf_in_blocks), ("scan", inverse_cdf_whole_rows)):
            device_ms, host_ms = timed(functools.partial(draw_fn, probs, u), device, args.repeats)
            print(
                f"batch {batch:4} {name:12}: device {device_ms:7.3f} ms, launch {host_ms:6.3f} ms",
                flush=True,
            )


def draw(
    launch: Callable[..., PendingSample],
    logits: torch.Tensor,
    seqs: list[SequenceSampling],
    mask: FilledMask | None,
) -> None:
    with torch.inference_mode():
        launch(logits, seqs, mask).result()


if __name__ == "__main__":
    main()
