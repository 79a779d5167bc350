"""Engine parity on one device: the Mojo kernels (attention and fused ops, replayed from CUDA
graphs where both are graph-safe) against the torch reference (TorchAttention and TorchFusedOps,
eager) on the same random checkpoint, teacher-forced so every step compares like with like.

    python3 benchmarks/engine_parity.py                                      # GPU: Qwen3-0.6B bf16
    python3 benchmarks/engine_parity.py --device cpu --preset tiny --dtype fp32

Both runners prefill the same --batch prompts, then decode --steps steps; each step feeds both
the reference's greedy tokens (teacher forcing: a token the two disagree on would otherwise make
every later step incomparable). One line per check as it goes, the prefill's logits then each
decode step's: max |diff| / max |ref| and the share of rows whose argmax agrees; the verdict last.
Exit 1 on a non-finite logit, a relative error above 0.1 or argmax agreement below 0.5 (bf16
over 28 layers: expect ~1e-2 and >= 0.8).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_gpu import DTYPES
from benchmarks.presets import CHOICES, DEFAULT_CACHE, preset_checkpoint
from kernels.backend import select_attention, select_fused_ops
from mili.engine.kv.block_pool import BlockPool, blocks_needed
from mili.engine.model.attention import TorchAttention
from mili.engine.model.fused_ops import TorchFusedOps
from mili.engine.model.loader import load_model
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.runner import ModelRunner
from mili.engine.step.sequence import Sequence

MAX_REL_ERR = 0.1
MIN_ARGMAX_AGREEMENT = 0.5


def compare(what: str, ref: torch.Tensor, got: torch.Tensor) -> bool:
    """Print one line comparing logits [B, vocab]; whether they pass."""
    ref, got = ref.float(), got.float()
    finite = bool(torch.isfinite(got).all())
    rel = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(
        f"{what:14} max|diff|/max|ref| {rel:.3e}  argmax agree {agree:.3f}  finite {finite}",
        flush=True,
    )
    return finite and rel <= MAX_REL_ERR and agree >= MIN_ARGMAX_AGREEMENT


def runner_for(model: Qwen3ForCausalLM, args: argparse.Namespace, per_seq: int) -> ModelRunner:
    """A runner for --batch sequences of `per_seq` blocks; its decode step captured in CUDA
    graphs where the model's kernels allow (what decode serves)."""
    runner = ModelRunner.create(
        model, args.batch * per_seq, args.block_size, max_decode_batch=args.batch
    )
    graph_safe = getattr(model.attention, "is_graph_safe", False) and model.fused_ops.is_graph_safe
    if runner.device.type == "cuda" and graph_safe:
        runner.capture_graphs()
    return runner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="qwen3-0.6b", choices=CHOICES)
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    # 6 rows replay the captured graph of 8: the 2 padded rows are exercised too.
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=300, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=12, help="decode steps compared")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    started = time.perf_counter()

    path = preset_checkpoint(args.preset, args.cache_dir)
    reference = load_model(
        path, device=device, dtype=dtype, attention=TorchAttention(), fused_ops=TorchFusedOps()
    )
    head_dim = reference.config.head_dim
    mojo = load_model(
        path,
        device=device,
        dtype=dtype,
        attention=select_attention("mojo", device, head_dim=head_dim),
        fused_ops=select_fused_ops("mojo", device, head_dim=head_dim),
    )
    per_seq = blocks_needed(args.prompt + args.steps + 2, args.block_size)
    runners = {
        "torch": runner_for(reference, args, per_seq),
        "mojo": runner_for(mojo, args, per_seq),
    }
    graphs = runners["mojo"].graphs
    print(
        f"# {args.preset} {args.dtype} on {device}: mojo attention {mojo.attention.name}, "
        f"fused {mojo.fused_ops.name}, graphs {'none' if graphs is None else graphs.batch_sizes}; "
        f"ready in {time.perf_counter() - started:.1f} s",
        flush=True,
    )

    vocab_size = reference.config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, min(vocab_size, 30000), (args.batch, args.prompt), generator=g)
    params = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True)
    seqs: dict[str, list[Sequence]] = {}
    logits: dict[str, torch.Tensor] = {}
    for name, runner in runners.items():
        pool = BlockPool(runner.num_blocks, null_block=True)
        seqs[name] = []
        for prompt in prompts.tolist():
            seq = Sequence.new(prompt, params, vocab_size=vocab_size, eos_token_ids=[])
            seq.block_table = pool.allocate(per_seq)
            seqs[name].append(seq)
        tables = [s.block_table for s in seqs[name]]
        with torch.inference_mode():
            # clone: the runner's output buffers are reused by its next call
            logits[name] = runner.prefill(prompts.tolist(), tables, [0] * args.batch).clone()

    failed = [] if compare("prefill", logits["torch"], logits["mojo"]) else ["prefill"]
    for step in range(args.steps):
        tokens = logits["torch"].argmax(-1).tolist()  # teacher forcing: the reference's tokens
        for name, runner in runners.items():
            for seq, token in zip(seqs[name], tokens, strict=True):
                seq.append(token)
            logits[name] = runner.decode_logits(seqs[name]).clone()
        if not compare(f"decode {step}", logits["torch"], logits["mojo"]):
            failed.append(f"decode {step}")
    verdict = "FAIL " + ", ".join(failed) if failed else "ok"
    print(f"# verdict: {verdict} ({time.perf_counter() - started:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
