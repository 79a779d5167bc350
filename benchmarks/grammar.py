"""Structured output on the CPU: xgrammar against llguidance on MILI's tokenizers.

For each engine and tokenizer, in a fresh child process each (so memory is the engine's own):

    tokenizer   the demo model's (836 tokens, 896 model rows) and a Qwen3-sized byte-level BPE
                (benchmarks/token_path.py build_tokenizer(): 151,643 regular tokens + control
                tokens, 151,936 model rows, as Qwen3)
    info        seconds to build the engine's tokenizer object (llguidance LLTokenizer from
                tokenizer.json; xgrammar TokenizerInfo.from_huggingface)
    compile     cold seconds from the constraint to its first mask: three JSON schemas, any
                JSON object, a regex, a choice, a GBNF grammar (compact JSON: no free whitespace)
    mask        per-token time to fill one bitmask row (median and p99 over a random walk:
                logits torch.randn, masked, temperature 1, until the grammar ends), and one
                fill of 64 rows with the engine's batch call
    memory      RSS growth (MiB) over the import for the tokenizer object, then for the compiles
    probes      JSON-schema keywords: 'refused' (compile error), 'enforced' (a valid instance
                passes and a violating one is rejected) or 'IGNORED' (the violating one passes)

xgrammar need not be in the venv: `--xgrammar-path DIR` puts a `pip install --no-deps --target
DIR xgrammar==0.2.8 apache-tvm-ffi` on sys.path (it declares triton, which a CPU run does not use).

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/grammar.py --xgrammar-path /tmp/xgpkgs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "owner": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "ok": {"type": "boolean"},
                },
                "required": ["name"],
            },
            "score": {"type": "number"},
        },
        "required": ["id", "owner"],
    },
    "wide": {
        "type": "object",
        "properties": {f"field_{i}": {"type": ["string", "integer", "null"]} for i in range(40)},
        "required": [f"field_{i}" for i in range(0, 40, 2)],
    },
}
REGEX = r"[A-Z]{3}-[0-9]{2,4}( (ok|fail))?"
CHOICE = ["positive", "negative", "neutral", "mixed feelings"]
GBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
# keyword: (schema, a valid instance, an instance only that keyword forbids)
PROBES: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "pattern": ({"type": "string", "pattern": "^[a-c]+$"}, "abc", "xyz"),
    "format:email": ({"type": "string", "format": "email"}, "a@b.co", "nope"),
    "format:date-time": ({"type": "string", "format": "date-time"}, "2024-01-02T03:04:05Z", "x"),
    "minimum": ({"type": "integer", "minimum": 5}, 7, 3),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 1}, 0, 1),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, 6, 4),
    "maxLength": ({"type": "string", "maxLength": 3}, "ab", "abcd"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [1], [1, 2, 3]),
    "uniqueItems": (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        [1, 2],
        [1, 1],
    ),
    "contains": (
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}},
        [1],
        [2],
    ),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
        [1],
        ["a"],
    ),
    "enum": ({"enum": ["x", 2]}, 2, "y"),
    "$ref": ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"}, 1, "s"),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, 3, 1),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, 1, True),
    "oneOf": (
        {"oneOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 3}]},
        1,
        4,
    ),
    "not": ({"not": {"type": "integer"}}, "a", 1),
    "if/then": ({"if": {"type": "integer"}, "then": {"minimum": 2}}, 3, 1),
    "additionalProperties:false": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        {"a": 1},
        {"b": 1},
    ),
    "patternProperties": (
        {
            "type": "object",
            "patternProperties": {"^x": {"type": "integer"}},
            "additionalProperties": False,
        },
        {"x": 1},
        {"x": "s"},
    ),
    "maxProperties": ({"type": "object", "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 2}}, {"ab": 1}, {"abc": 1}),
    "dependentRequired": (
        {"type": "object", "dependentRequired": {"a": ["b"]}},
        {"a": 1, "b": 1},
        {"a": 1},
    ),
}


def tokenizer_dir(name: str, cache: Path) -> tuple[Path, int]:
    """(directory holding tokenizer.json, the model's vocabulary rows) for `name`."""
    from mili.demo import tokenizer as demo

    directory = cache / name
    if name == "demo":
        tokenizer = demo.train_tokenizer()
        rows = (tokenizer.get_vocab_size(with_added_tokens=True) + 63) // 64 * 64
    else:
        rows = 151_936
        if (directory / "tokenizer.json").exists():
            return directory, rows
        from benchmarks.token_path import build_tokenizer

        tokenizer = build_tokenizer()
    demo.write_tokenizer_files(directory, tokenizer, 4096)
    return directory, rows


def qwen3_grammar_tokenizer(cache: Path) -> Any:
    """llguidance's view (GrammarTokenizer) of the Qwen3-sized tokenizer, its last token the
    EOS id (as constrained_decode.py's model has it)."""
    from mili.engine.constraint.vocab import GrammarTokenizer

    directory, rows = tokenizer_dir("qwen3", cache)
    path = directory / "tokenizer.json"
    vocab = GrammarTokenizer.from_file(path, rows, [0]).num_tokens
    return GrammarTokenizer.from_file(path, rows, [vocab - 1])


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Llguidance:
    def __init__(self, directory: Path, rows: int, eos: int) -> None:
        import llguidance as llg

        # Not llguidance.torch: importing it runs torch.compile's decorator (~3 s, ~120 MiB).
        self.llg, self.rows = llg, rows
        self.tok = llg.LLTokenizer(
            (directory / "tokenizer.json").read_text(), n_vocab=rows, eos_token=eos
        )
        self.options = {"whitespace_flexible": False}

    def compile(self, kind: str, text: str) -> Any:
        llg = self.llg
        if kind == "json_schema":
            grammar = llg.LLMatcher.grammar_from_json_schema(text, overrides=self.options)
        elif kind == "gbnf":
            grammar = llg.grammar_from("gbnf", text)
        else:
            grammar = llg.grammar_from(kind, text)
        # The compile: a matcher in its start state and its first mask (llguidance builds its
        # lexer lazily; mili/engine/constraint/compiler.py does the same), copied per request.
        template = llg.LLMatcher(self.tok, grammar, log_level=0)
        if not template.is_error():
            template.compute_bitmask()
        if template.is_error():
            raise ValueError(template.get_error())
        return template

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: Any) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.shape[1] * 4)

    def fill_batch(self, matchers: list[Any], bitmask: Any) -> None:
        if not hasattr(self, "executor"):
            self.executor = self.llg.LLExecutor(num_threads=2)
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers)
        )

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def finished(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())

    def accepts_text(self, compiled: Any, text: str) -> bool:
        m = self.matcher(compiled)
        return bool(m.consume_tokens(self.tok.tokenize_str(text)) and m.is_accepting())

    def first_mask(self, compiled: Any, bitmask: Any) -> None:
        pass  # computed by compile()


class Xgrammar:
    def __init__(self, directory: Path, rows: int, eos: int) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr, self.rows, self.eos = xgr, rows, eos
        hf = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=rows, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, text: str) -> Any:
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
        if kind == "json":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(x) for x in json.loads(text))
            return c.compile_grammar(f"root ::= {alternatives}")
        return c.compile_grammar(text)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def fill_batch(self, matchers: list[Any], bitmask: Any) -> None:
        if not hasattr(self, "batch"):
            self.batch = self.xgr.BatchGrammarMatcher(max_threads=2)
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def finished(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())

    def accepts_text(self, compiled: Any, text: str) -> bool:
        m = self.matcher(compiled)
        return bool(m.accept_string(text) and m.accept_token(self.eos))

    def first_mask(self, compiled: Any, bitmask: Any) -> None:
        self.fill(self.matcher(compiled), bitmask)


def _cases() -> list[tuple[str, str, str]]:
    cases = [(f"schema:{n}", "json_schema", json.dumps(s)) for n, s in SCHEMAS.items()]
    return [
        *cases,
        ("json_object", "json", '{"type": "object"}'),
        ("regex", "regex", REGEX),
        ("choice", "choice", json.dumps(CHOICE)),
        ("gbnf", "gbnf", GBNF),
    ]


def child(engine_name: str, tokenizer: str, cache: Path, walks: int) -> dict[str, Any]:
    import torch

    from mili.demo import tokenizer as demo

    directory, rows = tokenizer_dir(tokenizer, cache)
    from tokenizers import Tokenizer

    eos = demo.token_id(Tokenizer.from_file(str(directory / "tokenizer.json")), demo.EOS_TOKEN)
    engine_cls = Llguidance if engine_name == "llguidance" else Xgrammar
    __import__("llguidance" if engine_name == "llguidance" else "xgrammar")
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    engine = engine_cls(directory, rows, eos)
    out: dict[str, Any] = {"info_s": time.perf_counter() - t0, "info_rss_mib": _rss_mib() - rss0}
    rss1 = _rss_mib()
    compiled: dict[str, Any] = {}
    out["compile_s"] = {}
    bitmask = torch.zeros((1, (rows + 31) // 32), dtype=torch.int32)
    for name, kind, text in _cases():
        t0 = time.perf_counter()
        compiled[name] = engine.compile(kind, text)
        engine.first_mask(compiled[name], bitmask)  # compile -> first mask, for both engines
        out["compile_s"][name] = time.perf_counter() - t0
    out["compile_rss_mib"] = _rss_mib() - rss1
    bits = torch.arange(32, dtype=torch.int32)
    out["mask_ms"] = {}
    for name, _, _ in _cases():
        times: list[float] = []
        for seed in range(walks):
            gen = torch.Generator().manual_seed(seed)
            m = engine.matcher(compiled[name])
            for _ in range(400):
                t0 = time.perf_counter()
                engine.fill(m, bitmask)
                times.append(time.perf_counter() - t0)
                allowed = ((bitmask[0].unsqueeze(1) >> bits) & 1).flatten()[:rows].bool()
                logits = torch.randn(rows, generator=gen).masked_fill(~allowed, float("-inf"))
                token = int(torch.multinomial(torch.softmax(logits, 0), 1, generator=gen))
                assert engine.accept(m, token), (name, token)
                if token == eos or engine.finished(m):
                    break
        times.sort()
        out["mask_ms"][name] = {
            "median": statistics.median(times) * 1e3,
            "p99": times[int(0.99 * (len(times) - 1))] * 1e3,
            "steps": len(times),
        }
    batch = torch.zeros((64, (rows + 31) // 32), dtype=torch.int32)
    matchers = [engine.matcher(compiled["schema:nested"]) for _ in range(64)]
    t0 = time.perf_counter()
    for _ in range(10):
        engine.fill_batch(matchers, batch)
    out["batch64_fill_ms"] = (time.perf_counter() - t0) / 10 * 1e3
    out["probes"] = {}
    for keyword, (schema, good, bad) in PROBES.items():
        try:
            grammar = engine.compile("json_schema", json.dumps(schema))
        except Exception as e:
            out["probes"][keyword] = f"refused: {str(e).splitlines()[0][:80]}"
            continue
        compact = {"separators": (",", ":")}
        ok = engine.accepts_text(grammar, json.dumps(good, **compact))  # type: ignore[arg-type]
        leaks = engine.accepts_text(grammar, json.dumps(bad, **compact))  # type: ignore[arg-type]
        out["probes"][keyword] = "IGNORED" if leaks else ("enforced" if ok else "over-strict")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--xgrammar-path", help="a --target directory holding xgrammar")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/mili-grammar-bench"))
    parser.add_argument("--walks", type=int, default=5, help="random walks per constraint")
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "TOKENIZER"), help=argparse.SUPPRESS)
    parser.add_argument("--tokenizers", default="demo,qwen3")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.xgrammar_path:
        sys.path.insert(0, args.xgrammar_path)
    if args.child:
        engine_name, tokenizer = args.child
        print(json.dumps(child(engine_name, tokenizer, args.cache, args.walks)))
        return
    print(f"load average {os.getloadavg()}", file=sys.stderr)
    results: dict[str, Any] = {}
    for tokenizer in args.tokenizers.split(","):
        for engine in ("llguidance", "xgrammar"):
            command = [
                sys.executable,
                __file__,
                "--child",
                engine,
                tokenizer,
                "--cache",
                str(args.cache),
            ]
            command += ["--walks", str(args.walks)]
            if args.xgrammar_path:
                command += ["--xgrammar-path", args.xgrammar_path]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            if done.returncode:
                print(done.stderr, file=sys.stderr)
                continue
            results[f"{engine}/{tokenizer}"] = json.loads(done.stdout.splitlines()[-1])
            print(f"{engine}/{tokenizer}: {json.dumps(results[f'{engine}/{tokenizer}'])}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"load average {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    main()
