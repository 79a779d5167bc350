"""Where a constrained decode step's mask fill goes (issue 31): llguidance on the Qwen3-sized
tokenizer and constrained_decode.py's schema, on the CPU.

    masks       one matcher walked through the schema (tokens drawn uniformly among the
                allowed ones, a fresh matcher when one finishes): each new state's mask time,
                median and mean, and the share of the time in masks over 100 us (with the
                text before the costliest)
    copies      8 fresh matchers in one costly state (inside a string with a maxLength), their
                masks filled in one call on 1 and on 2 llguidance threads: as deep copies of
                one compiled grammar, then as 8 separate compiles (copies share the lexer)
    lanes       64 rows walked as in `masks`, filled each step by BatchMasker as decode fills
                them: 1 lane and 1 thread against N lanes and N threads (CompileConfig.lanes)

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/mask_fill.py --lanes 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llguidance
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.constrained_decode import SCHEMA
from benchmarks.grammar import qwen3_grammar_tokenizer
from benchmarks.presets import DEFAULT_CACHE
from mili.engine.constraint.compiler import CompileConfig, ConstraintCompiler, grammar_text
from mili.engine.constraint.mask import BatchMasker, unpack_bitmask
from mili.engine.constraint.matcher import ConstraintMatcher
from mili.engine.constraint.spec import Constraint
from mili.engine.constraint.vocab import GrammarTokenizer

ROWS = 151_936
COSTLY_PREFIX = '{"name":" pone'  # inside "name" (maxLength 12): ~100k tokens allowed


def allowed_ids(bitmask: Any, tokenizer: GrammarTokenizer) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(bytes(bitmask), dtype=np.uint8), bitorder="little")
    ids = np.flatnonzero(bits[:ROWS])
    return ids[ids < tokenizer.num_tokens]


def masks(compiled: Any, tokenizer: GrammarTokenizer, steps: int) -> None:
    rng = np.random.default_rng(0)
    matcher, text, timed = compiled.matcher(), b"", []
    for _ in range(steps):
        t0 = time.perf_counter()
        bitmask = matcher.ll.compute_bitmask()
        timed.append(((time.perf_counter() - t0) * 1e6, text[-24:]))
        token = int(rng.choice(allowed_ids(bitmask, tokenizer)))
        assert matcher.accept(token)
        text += bytes(tokenizer.ll.decode_bytes([token]))
        if matcher.is_finished:
            matcher, text = compiled.matcher(), b""
    us = [t for t, _ in timed]
    costly = sum(t for t in us if t > 100) / sum(us)
    worst = max(timed)
    print(
        f"masks: {len(us)} states, median {statistics.median(us):.1f} us, mean "
        f"{statistics.mean(us):.1f} us; {costly:.0%} of the time in masks over 100 us "
        f"(the costliest {worst[0]:.0f} us, after {worst[1]!r})"
    )


def copies(compiled: Any, tokenizer: GrammarTokenizer, grammar: str) -> None:
    prefix = tokenizer.ll.tokenize_str(COSTLY_PREFIX)
    words = tokenizer.num_mask_words
    buffer = np.zeros((8, words), dtype=np.int32)

    def fresh(separate: bool) -> list[Any]:
        rows = []
        for _ in range(8):
            ll = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0) if separate else None
            matcher = ConstraintMatcher(ll, tokenizer) if ll else compiled.matcher()
            assert all(matcher.accept(t) for t in prefix)
            rows.append(matcher.ll)
        return rows

    for separate in (False, True):
        cells = []
        for threads in (1, 2):
            executor = llguidance.LLExecutor(num_threads=threads)
            times = []
            for _ in range(10):
                rows = fresh(separate)
                pairs = [(row, i) for i, row in enumerate(rows)]
                t0 = time.perf_counter()
                executor.unsafe_compute_mask_ptr(pairs, buffer.ctypes.data, words * 4, 8)
                times.append(time.perf_counter() - t0)
            cells.append(f"{threads} thread(s) {statistics.median(times) * 1e3:.2f} ms")
        kind = "separate compiles" if separate else "deep copies of one compile"
        print(f"copies: 8 fresh matchers after {COSTLY_PREFIX!r}, {kind}: {', '.join(cells)}")


def lanes(tokenizer: GrammarTokenizer, num_lanes: int, steps: int) -> None:
    for n in (1, num_lanes):
        compiler = ConstraintCompiler(tokenizer, CompileConfig(lanes=n))
        compiled = compiler.compile_sync(Constraint.json_schema(SCHEMA))
        while len(compiled.lanes) < n:  # the other lanes compile after the first
            time.sleep(0.01)
        rows = [compiled.matcher() for _ in range(64)]
        masker = BatchMasker(tokenizer, 64, num_threads=n)
        rng = np.random.default_rng(0)
        fills = []
        for _ in range(steps):
            t0 = time.perf_counter()
            filled = masker.fill(rows)
            fills.append(time.perf_counter() - t0)
            assert filled is not None
            allowed = unpack_bitmask(filled.bitmask, ROWS).numpy()
            for i, matcher in enumerate(rows):
                assert matcher.accept(int(rng.choice(np.flatnonzero(allowed[i]))))
                if matcher.is_finished:
                    rows[i] = compiled.matcher()
        masker.close()
        print(
            f"lanes: {n} lane(s), {n} thread(s): 64 rows' fill median "
            f"{statistics.median(fills) * 1e3:.2f} ms, mean {statistics.mean(fills) * 1e3:.2f} ms"
            f" ({steps} steps)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, default=2, help="lanes (and threads) against 1")
    parser.add_argument("--steps", type=int, default=60, help="fills per lanes arm")
    parser.add_argument("--states", type=int, default=3000, help="states walked in `masks`")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    tokenizer = qwen3_grammar_tokenizer(args.cache_dir)
    compiler = ConstraintCompiler(tokenizer)
    constraint = Constraint.json_schema(SCHEMA)
    compiled = compiler.compile_sync(constraint)
    grammar = grammar_text(constraint)
    masks(compiled, tokenizer, args.states)
    copies(compiled, tokenizer, grammar)
    lanes(tokenizer, args.lanes, args.steps)


if __name__ == "__main__":
    main()
