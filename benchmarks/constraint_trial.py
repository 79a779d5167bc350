"""What trying each first compile in a child process (mili/engine/constraint/trial.py) costs.

On a Qwen3-sized tokenizer (benchmarks/grammar.py's, 151,936 rows), for distinct variants of
benchmarks/grammar.py's JSON schemas (a property renamed per variant, so none is a cache hit):

    start      seconds to start a child (Python, llguidance, the tokenizer, a warm-up compile)
    in-process a cold compile on this thread (compiler.build: grammar, matcher, first mask)
    trial      the same compile in the child, as the compiler asks it (send, compile, answer)
    miss       ConstraintCompiler.compile_sync on a miss: the trial, then the in-process compile
    size       the memory each compile took, as the child measured it (the cache's weight)

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/constraint_trial.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.grammar import SCHEMAS, qwen3_grammar_tokenizer
from benchmarks.presets import DEFAULT_CACHE
from mili.engine.constraint.compiler import CompileConfig, ConstraintCompiler, build
from mili.engine.constraint.spec import Constraint
from mili.engine.constraint.trial import CompileTrials


def variant(schema: dict[str, Any], i: int) -> Constraint:
    text = json.dumps(schema)
    first = next(iter(schema.get("properties", {"x": None})))
    return Constraint.json_schema(text.replace(f'"{first}"', f'"{first}{i}"'))


def ms(samples: list[float]) -> str:
    return f"median {statistics.median(samples) * 1e3:.1f} ms, max {max(samples) * 1e3:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", type=int, default=10, help="distinct schemas per kind")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    tokenizer = qwen3_grammar_tokenizer(args.cache_dir)
    config = CompileConfig()
    trials = CompileTrials(tokenizer)
    started = time.perf_counter()
    trials.run(Constraint.regex("a"), config)  # starts the child
    print(f"start: {time.perf_counter() - started:.2f} s (the child's first constraint)")
    for name, schema in SCHEMAS.items():
        here, tried, missed, sizes = [], [], [], []
        compiler = ConstraintCompiler(tokenizer, config)
        compiler.compile_sync(Constraint.regex("a"))  # its child started
        for i in range(args.variants):
            constraint = variant(schema, i)
            t = time.perf_counter()
            build(constraint, tokenizer)
            here.append(time.perf_counter() - t)
            t = time.perf_counter()
            sizes.append(trials.run(constraint, config))
            tried.append(time.perf_counter() - t)
            t = time.perf_counter()
            compiler.compile_sync(variant(schema, i + args.variants))
            missed.append(time.perf_counter() - t)
        compiler.close()
        print(
            f"{name:>8}: in-process {ms(here)}; trial {ms(tried)}; miss {ms(missed)}; "
            f"size median {statistics.median(sizes) / 1e6:.2f} MB"
        )
    trials.close()


if __name__ == "__main__":
    main()
