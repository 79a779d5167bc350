"""Decode steps with a JSON-schema constraint on every row against unconstrained ones (issue 31's
<= 1.10x target), on the engine's real step path: ModelRunner.decode with the masks' fill
started on the masker's thread before the forward (as decode's batcher does), applied before
sampling, then each row's matcher accepts its token (Sequence.append).

Both arms run the same batch in the same process, alternating step by step, at temperature 1
(seeded). A row whose grammar finishes starts over with a fresh matcher (its sequence goes on),
so every step has all rows constrained. Also reported: the parts (one synchronous fill of the
batch's masks, one apply to the logits, the forward alone, each a step apart), the compile
cache (a second compile of the same schema is a hit: compiles counted, not timed in a unit
test), both arms again with decode's overlapped steps (CUDA's default: the next forward
launched before the last ids are in, the masks filled after them, during that forward), in
runs of 10 steps, and then each mode's step cut into its phases (`step_phases`). The masks
fill as decode fills them: `--mask-threads` llguidance threads over as many compile lanes.

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/constrained_decode.py \
        --model demo --model qwen3-0.6b
    python3 benchmarks/constrained_decode.py --device cuda --model qwen3-0.6b   # GPU host

On CUDA the model runs in bf16 with the kernels serving picks and the decode step replayed from
CUDA graphs, as decode serves it; the masks are filled on the host either way (the masker's
thread, during the forward) and applied on the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import DEFAULT_CACHE, preset_checkpoint
from kernels.choice import select_kernels
from kernels.self_check import CheckShape
from mili.engine.constraint.compiler import CompileConfig, ConstraintCompiler
from mili.engine.constraint.mask import BatchMasker, apply_token_bitmask, decode_mask_threads
from mili.engine.constraint.spec import Constraint
from mili.engine.constraint.vocab import GrammarTokenizer
from mili.engine.kv.block_pool import blocks_needed
from mili.engine.model.grouped_gemm import is_graph_safe
from mili.engine.model.loader import load_config, load_model
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.runner import Launched, ModelRunner
from mili.engine.step.sequence import Sequence

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
            "required": ["city"],
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "address"],
}
PROMPT_TOKENS = 16
WARMUP = 3  # untimed steps per arm first (page faults, allocator, lazy lexer states)
OVERLAP_STEPS = 10  # steps per overlapped run (their time divided by it)
PART_STEPS = 10  # steps of the parts measured one by one


def model_dirs(name: str, cache: Path) -> tuple[Path, Path, int]:
    """(checkpoint dir, dir with tokenizer.json, the tokenizer's size) for `name`."""
    if name == "demo":
        from mili.demo.model import build_demo_model

        path = build_demo_model(Path(tempfile.mkdtemp(prefix="mili-demo-")))
        return path, path, GrammarTokenizer.from_file(path / "tokenizer.json", 896, [0]).num_tokens
    from benchmarks.grammar import tokenizer_dir

    directory, _ = tokenizer_dir("qwen3", cache)
    tokenizer = GrammarTokenizer.from_file(directory / "tokenizer.json", 151_936, [0])
    return preset_checkpoint(name, cache), directory, tokenizer.num_tokens


def run(
    name: str, batch: int, steps: int, cache: Path, device: str, mask_threads: int
) -> dict[str, Any]:
    model_dir, tok_dir, vocab = model_dirs(name, cache)
    config = load_config(model_dir)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    dtype_name = str(dtype).removeprefix("torch.")
    kernels = select_kernels("auto", device, CheckShape.of(config, 16, dtype_name))  # as serving
    model = load_model(
        model_dir,
        device=device,
        dtype=dtype,
        attention=kernels.attention,
        fused_ops=kernels.fused_ops,
    )
    rows = model.config.vocab_size
    eos = [vocab - 1]
    tokenizer = GrammarTokenizer.from_file(tok_dir / "tokenizer.json", rows, eos)
    compiler = ConstraintCompiler(tokenizer, CompileConfig(lanes=mask_threads))  # as decode
    constraint = Constraint.json_schema(SCHEMA)
    t0 = time.perf_counter()
    compiled = compiler.compile_sync(constraint)
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    compiler.compile_sync(Constraint.json_schema(json.loads(json.dumps(SCHEMA))))
    second_ms = (time.perf_counter() - t0) * 1e3
    stats = compiler.stats()
    deadline = time.monotonic() + 30  # the other lanes compile after the first (compiler.py)
    while len(compiled.lanes) < mask_threads and time.monotonic() < deadline:
        time.sleep(0.01)

    block_size = 16
    blocks_of_steps = max(1, steps // OVERLAP_STEPS)  # the overlapped runs, per arm
    phase_steps = 2 * (PHASE_STEPS + 2)  # step_phases: sync, then overlapped, per arm
    positions = (
        PROMPT_TOKENS + WARMUP + steps + blocks_of_steps * OVERLAP_STEPS + phase_steps + PART_STEPS
    )
    per_seq = blocks_needed(positions, block_size)
    runner = ModelRunner.create(
        model, batch * per_seq, block_size, max_decode_batch=batch, vocab_size=vocab
    )
    # As the decode service decides (startup.graphs_allowed): a kernel family that fell back
    # to torch at its self-check, or MoE experts without a graph-safe GEMM, run eagerly.
    graph_safe = getattr(model.attention, "is_graph_safe", False) and model.fused_ops.is_graph_safe
    if model.config.is_moe:
        widths = (model.config.hidden_size, model.config.moe_intermediate_size)
        graph_safe = graph_safe and is_graph_safe(model.device, model.dtype, widths)
    graphs = runner.capture_graphs() if model.device.type == "cuda" and graph_safe else False
    masker = BatchMasker(tokenizer, batch, num_threads=mask_threads)
    gen = torch.Generator().manual_seed(0)
    arms: dict[str, list[Sequence]] = {}
    for arm in ("free", "json"):
        seqs = []
        for i in range(batch):
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=10**6, ignore_eos=True)
            table = list(range(i * per_seq, (i + 1) * per_seq))
            prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=gen).tolist()
            seq = Sequence.new(
                prompt, params, vocab_size=vocab, eos_token_ids=eos, block_table=table
            )
            seq.num_computed_tokens = PROMPT_TOKENS
            if arm == "json":
                seq.matcher = compiled.matcher()
            seqs.append(seq)
        first = masker.fill([s.matcher for s in seqs])
        logits = torch.randn(batch, rows, device=model.device)
        out = runner.sampler(logits, [s.sampling for s in seqs], first)
        for seq, token in zip(seqs, out.token_ids, strict=True):
            seq.append(token)
        arms[arm] = seqs

    times: dict[str, list[float]] = {"free": [], "json": []}
    restarts = 0
    for r in range(WARMUP + steps):  # the arms alternate step by step (the order flipped)
        for arm in ("free", "json") if r % 2 == 0 else ("json", "free"):
            seqs = arms[arm]
            start = time.perf_counter()
            masks = masker.start([s.matcher for s in seqs])
            result = runner.decode(seqs, masks).result()
            for seq, token in zip(seqs, result.token_ids, strict=True):
                seq.append(token)
                seq.num_computed_tokens = seq.num_tokens - 1
            if r >= WARMUP:
                times[arm].append(time.perf_counter() - start)
            for seq in seqs:
                if seq.matcher is not None and seq.matcher.is_finished:
                    seq.matcher = compiled.matcher()  # all rows constrained every step
                    restarts += 1

    def collect(seqs: list[Sequence], pending: Launched) -> int:
        return append_ids(seqs, pending.sample.result().token_ids, compiled)

    def overlapped(seqs: list[Sequence]) -> float:
        """ms per step over OVERLAP_STEPS steps as decode runs them on CUDA (--overlap-steps):
        each forward launched before the last step's ids are in, then those ids appended, the
        masks filled (on this thread, during the forward), the sampling launched."""
        nonlocal restarts
        _sync(model.device)
        start = time.perf_counter()
        pending = Launched(seqs, runner.decode(seqs, masker.start([s.matcher for s in seqs])))
        for _ in range(OVERLAP_STEPS - 1):
            logits = runner.decode_logits(seqs, ahead=pending)
            restarts += collect(seqs, pending)
            mask = masker.fill([s.matcher for s in seqs])
            pending = Launched(seqs, runner.sample(logits, [s.sampling for s in seqs], mask))
        restarts += collect(seqs, pending)
        return (time.perf_counter() - start) * 1e3 / OVERLAP_STEPS

    overlap_ms: dict[str, list[float]] = {"free": [], "json": []}
    for r in range(blocks_of_steps):  # the arms alternate block by block
        for arm in ("free", "json") if r % 2 == 0 else ("json", "free"):
            overlap_ms[arm].append(overlapped(arms[arm]))

    phases = {
        (mode, arm): step_phases(runner, masker, arms[arm], compiled, overlap=mode == "overlapped")
        for mode in ("sync", "overlapped")
        for arm in ("free", "json")
    }

    # The parts, once more each on the json arm's state (synchronous, not overlapped), a step
    # apart: llguidance hands back a matcher's last mask while its state is unchanged, so a
    # fill of unchanged states would time a cache hit.
    seqs = arms["json"]
    fill_s, apply_s, forward_s = [], [], []
    for _ in range(PART_STEPS):
        t0 = time.perf_counter()
        mask = masker.fill([s.matcher for s in seqs])
        fill_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        logits = runner.decode_logits(seqs)
        _sync(model.device)
        forward_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        apply_token_bitmask(logits[:, :vocab], mask)
        _sync(model.device)
        apply_s.append(time.perf_counter() - t0)
        sampled = runner.sample(logits, [s.sampling for s in seqs])  # masked already
        restarts += collect(seqs, Launched(seqs, sampled))
    masker.close()
    med = {arm: statistics.median(t) * 1e3 for arm, t in times.items()}
    med_overlap = {arm: statistics.median(t) for arm, t in overlap_ms.items()}
    return {
        "model": name,
        "device": str(model.device),
        "graphs": graphs,
        "batch": batch,
        "mask_threads": mask_threads,
        "steps": len(times["json"]),
        "free_ms": med["free"],
        "json_ms": med["json"],
        "ratio": med["json"] / med["free"],
        "free_overlap_ms": med_overlap["free"],
        "json_overlap_ms": med_overlap["json"],
        "ratio_overlap": med_overlap["json"] / med_overlap["free"],
        "fill_ms": statistics.median(fill_s) * 1e3,
        "apply_ms": statistics.median(apply_s) * 1e3,
        "forward_ms": statistics.median(forward_s) * 1e3,
        "grammars_finished": restarts,
        "compile_first_ms": first_ms,
        "compile_second_ms": second_ms,
        "compiles": stats.misses,
        "cache_hits": stats.hits,
        "phases": phases,
    }


PHASE_STEPS = 30  # steps per (mode, arm) in the phase breakdown


def append_ids(seqs: list[Sequence], ids: list[int], compiled: Any) -> int:
    """Append a step's ids (the matchers accept them); a finished grammar starts over, so
    every row stays constrained. -> how many started over"""
    restarts = 0
    for seq, token in zip(seqs, ids, strict=True):
        seq.append(token)
        seq.num_computed_tokens = seq.num_tokens - 1
        if seq.matcher is not None and seq.matcher.is_finished:
            seq.matcher = compiled.matcher()
            restarts += 1
    return restarts


def step_phases(
    runner: ModelRunner,
    masker: BatchMasker,
    seqs: list[Sequence],
    compiled: Any,
    *,
    overlap: bool,
) -> dict[str, list[float]]:
    """The step of `run`'s arms cut into its host phases (ms each, per step), with the device's
    time between the phases' CUDA events: where a constrained step's extra time goes.

    sync (as `ModelRunner.decode`): fill started on the masker's thread, forward launched,
    fill waited for, sampling launched, ids waited for, appended (accepts). overlapped (as
    decode's batcher on CUDA): next forward launched, last ids waited for and appended, masks
    filled on this thread, sampling launched. "step" is the loop's period; "device forward"
    and "device sample" are the stream's time from one event to the next, so "device sample"
    includes any time the device sat waiting for the host to launch the sampling."""
    cuda = runner.device.type == "cuda"
    out: dict[str, list[float]] = {}
    events: list[tuple[Any, Any, Any]] = []

    def event() -> Any:
        if not cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    _sync(runner.device)
    pending: Launched | None = None
    last = time.perf_counter()
    marks: list[tuple[str, float]] = []  # this step's (phase, its end)

    def mark(name: str) -> None:
        marks.append((name, time.perf_counter()))

    for i in range(PHASE_STEPS + 1):
        marks.clear()
        if not overlap or pending is None:
            started = masker.start([s.matcher for s in seqs])
            mark("start fill")
            e0 = event()
            logits = runner.decode_logits(seqs)
            e1 = event()
            mark("launch forward")
            mask = started.result() if started is not None else None
            mark("wait fill")
            sample = runner.sample(logits, [s.sampling for s in seqs], mask)
            e2 = event()
            mark("launch sample")
            if overlap:
                pending = Launched(seqs, sample)
            else:
                append_ids(seqs, sample.result().token_ids, compiled)
                mark("wait ids + accept")
        else:
            e0 = event()
            logits = runner.decode_logits(seqs, ahead=pending)
            e1 = event()
            mark("launch forward")
            ids = pending.sample.result().token_ids
            mark("wait ids")
            append_ids(seqs, ids, compiled)
            mark("accept")
            mask = masker.fill([s.matcher for s in seqs])
            mark("fill")
            pending = Launched(seqs, runner.sample(logits, [s.sampling for s in seqs], mask))
            e2 = event()
            mark("launch sample")
        if i == 0:  # the pipeline's first step (overlapped: not yet overlapped)
            last = marks[-1][1]
            continue
        events.append((e0, e1, e2))
        for name, t in marks:
            out.setdefault(name, []).append((t - last) * 1e3)
            last = t
        out.setdefault("step", []).append(sum(out[name][-1] for name, _ in marks))
    if pending is not None:
        append_ids(seqs, pending.sample.result().token_ids, compiled)
    _sync(runner.device)
    if cuda:
        out["device forward"] = [e0.elapsed_time(e1) for e0, e1, _ in events]
        out["device sample"] = [e1.elapsed_time(e2) for _, e1, e2 in events]
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="demo or a preset (repeatable)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per arm")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--mask-threads",
        type=int,
        default=decode_mask_threads(),
        help="llguidance threads filling the masks (default: as decode, half the cores, 1-8)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        "| model | batch | steps/arm | unconstrained ms | JSON schema ms | ratio | fill ms "
        "| apply ms | forward ms | grammars finished | compile 1st ms | 2nd ms | compiles "
        "| hits | overlapped: unconstrained ms | JSON schema ms | ratio |"
    )
    print("| --- " * 17 + "|")
    with torch.inference_mode():
        for name in args.model or ["demo"]:
            r = run(name, args.batch, args.steps, args.cache_dir, args.device, args.mask_threads)
            where = (
                r["device"]
                + (" graphs" if r["graphs"] else "")
                + f", {r['mask_threads']} mask thread{'s' if r['mask_threads'] != 1 else ''}"
            )
            print(
                f"| {r['model']} ({where}) | {r['batch']} | {r['steps']} | {r['free_ms']:.2f} "
                f"| {r['json_ms']:.2f} | {r['ratio']:.2f}x | {r['fill_ms']:.2f} "
                f"| {r['apply_ms']:.2f} | {r['forward_ms']:.2f} | {r['grammars_finished']} "
                f"| {r['compile_first_ms']:.2f} | {r['compile_second_ms']:.3f} "
                f"| {r['compiles']} | {r['cache_hits']} | {r['free_overlap_ms']:.2f} "
                f"| {r['json_overlap_ms']:.2f} | {r['ratio_overlap']:.2f}x |",
                flush=True,
            )
            print_phases(r["phases"])


def print_phases(phases: dict[tuple[str, str], dict[str, list[float]]]) -> None:
    """One line per (mode, arm): each phase's median ms, and the step's mean and max (a slow
    step, such as a lexer state llguidance builds the first time, shows there)."""
    for (mode, arm), parts in phases.items():
        step = parts["step"]
        cells = ", ".join(
            f"{name} {statistics.median(ms):.3f}" for name, ms in parts.items() if name != "step"
        )
        print(
            f"  phases {mode:10} {arm:4}: step median {statistics.median(step):.2f} mean "
            f"{statistics.mean(step):.2f} max {max(step):.2f} ms; {cells}",
            flush=True,
        )


if __name__ == "__main__":
    main()
