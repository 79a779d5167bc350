"""Constraint -> compiled grammar for one tokenizer: cached, off the event loop, time-limited.

    compile(c) ──▶ validate sizes ──▶ LRU hit? ──yes──▶ CompiledConstraint
                                         │ no (or joins a compile already running for c)
                                         ▼
                  a fresh daemon thread: tried in a child process first (trial.py: killed past
                  timeout_s or max_compile_bytes), then grammar text -> llguidance.LLMatcher
                  here (the GIL dropped)
                                         │
                 wait at most timeout_s ─┴─ late: ResourceExhausted naming the field

A compile cannot be interrupted (llguidance's Rust code has no cancel), and some never end:
trial.py runs each first in a child that can be killed, so what runs here is a compile that
finished there within the limits. The caller still waits at most timeout_s for both, counted
from when the constraint reached a started child: a child's start (a second or so for Qwen3's
tokenizer, more on a loaded host) is not the constraint's time and has a bound of its own
(trial.START_TIMEOUT_S). One that times out gets ResourceExhausted at once, the thread runs on
and its result still lands in the cache. At most `max_compile_threads` compile threads (and so
children) run at a time; past that a compile is refused (ResourceExhausted with a retry hint)
rather than queued.

The cache key is (tokenizer fingerprint, constraint key): the compiled grammar depends on the
tokenizer file, the model's row count and the EOS ids as well as on the constraint. A compiled
constraint is a pristine matcher; each request gets a deep copy of it (~10 us). The cache is
bounded in entries and in the memory its constraints' compiles took (measured in the child).

Lanes: the masks of llguidance's deep copies of one compiled grammar are computed one at a
time however many threads fill them, those of separate compiles in parallel (measured:
docs/benchmarks.md, "Structured output on a GPU"). A compiler configured with `lanes` > 1
(decode: one per mask thread) therefore keeps that many independent compiles of each
constraint and deals requests out over them in turn. The first lane is the compile the caller
waits for; the others are compiled after it, on the same thread (still counted against
max_compile_threads), while requests already run on the first; a constraint whose first
compile here took over timeout_s / (lanes - 1) keeps its one lane.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import llguidance

from mili.engine.constraint import schema as schemas
from mili.engine.constraint.matcher import ConstraintMatcher, too_complex
from mili.engine.constraint.spec import Constraint, parse_schema, validate
from mili.engine.constraint.think import after_think, shortest_block
from mili.engine.constraint.trial import CompileTrials
from mili.engine.constraint.vocab import GrammarTokenizer
from mili.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only

_LOG = logging.getLogger("mili.engine")

# Compact JSON: no free whitespace between tokens (a sampler could otherwise emit blanks
# forever), "," and ":" as separators; unimplemented keywords are errors, not ignored (lenient
# off), and oneOf is refused rather than read as anyOf (coerce_one_of off).
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
    "lenient": False,
    "coerce_one_of": False,
}


@dataclass(frozen=True)
class CompileConfig:
    """How compiles run: wall-time limit, concurrent compile threads, cache size."""

    timeout_s: float = 5.0
    max_compile_threads: int = 4
    cache_entries: int = 512
    # The memory the cached constraints' compiles took, each measured in its trial's child
    # process (at least its text), once per lane: 512 large schemas took ~2 GB a process
    # (docs/benchmarks.md, "Constraint cache memory").
    cache_bytes: int = 256 << 20
    # A constraint whose compile takes more is refused (ResourceExhausted naming its field):
    # a schema at the size limit takes a few MB, the regex b{1000}{900} ~200 MB.
    max_compile_bytes: int = 64 << 20
    lanes: int = 1  # independent compiles of each constraint (module docstring)

    def __post_init__(self) -> None:
        if (
            self.timeout_s <= 0
            or self.max_compile_threads < 1
            or self.cache_entries < 1
            or self.cache_bytes < 1
            or self.max_compile_bytes < 1
            or self.lanes < 1
        ):
            raise ValueError(f"invalid {self}")


class _Compile:
    """A compile in flight, for its caller and any that join it."""

    def __init__(self, result: concurrent.futures.Future[CompiledConstraint]) -> None:
        self.result = result
        # time.monotonic() when the constraint reached a started child (set by the compile
        # thread): callers' timeout_s counts from there (module docstring).
        self.asked_at: float | None = None

    def left_s(self, timeout_s: float) -> float:
        """How long a caller waits on from now: until timeout_s after the ask, or another
        timeout_s while the child still starts (its start has a bound of its own)."""
        if self.asked_at is None:
            return timeout_s
        return self.asked_at + timeout_s - time.monotonic()


class CompileStats(NamedTuple):
    hits: int
    misses: int  # compiles started
    running: int  # compile threads alive now (late ones included)


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint compiled for one tokenizer; `matcher()` starts a request's state."""

    constraint: Constraint
    tokenizer: GrammarTokenizer
    template: Any  # llguidance.LLMatcher in its start state; never advanced

    field_name: str = "sampling.constraint"  # the request field, for errors mid-generation
    num_bytes: int = 0  # what it counts against CompileConfig.cache_bytes (all lanes)
    # every lane's start-state matcher, `template` first; the compile thread appends the rest
    lanes: list[Any] = field(default_factory=list, init=False, repr=False, compare=False)
    _turn: Iterator[int] = field(
        default_factory=itertools.count, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.lanes.append(self.template)

    def matcher(self) -> ConstraintMatcher:
        """A request's start state, copied from the lanes in turn."""
        lanes = self.lanes
        lane = next(self._turn) % len(lanes)
        return ConstraintMatcher(lanes[lane].deep_copy(), self.tokenizer, self.field_name, lane)


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for `constraint`, behind its think block (think.py);
    InvalidArgument when it cannot be written."""
    return after_think(_own_grammar(constraint), constraint.think)


def _own_grammar(constraint: Constraint) -> str:
    field_name = constraint.field_name()
    try:
        if constraint.kind == "json_schema":
            schema = parse_schema(constraint)
            unenforced = schemas.unenforced_bounds(schema)
            if unenforced is not None:
                raise InvalidArgument(field_name, constraint.text, unenforced)
            closed = schemas.close_objects(schema)
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(closed, overrides=JSON_OPTIONS)
            )
        if constraint.kind == "json_object":
            obj = {"type": "object"}
            return str(llguidance.LLMatcher.grammar_from_json_schema(obj, overrides=JSON_OPTIONS))
        if constraint.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(constraint.text))
        if constraint.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in constraint.choices)
            return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"))
        return str(llguidance.grammar_from("grammar", constraint.text))  # Lark, or GBNF converted
    except ValueError as e:
        raise InvalidArgument(field_name, constraint.text, f"does not parse: {e}") from None


def build(constraint: Constraint, tokenizer: GrammarTokenizer) -> tuple[Any, str]:
    """Compile on this thread (blocking): the start-state llguidance.LLMatcher, and the
    grammar text it was compiled from (for the other lanes).

    Behind a think block the constraint's own grammar is compiled alone first, as thinking off
    compiles it, and thrown away: llguidance builds a nested grammar's lexer only when the
    output reaches it, and the start state always has a way on (the block), so a grammar too
    big, too complex or at a dead end at its start would compile behind the block and fail
    only once the model had thought. Its answer's lexer is then built here (`_build_answer`)."""
    own = _own_grammar(constraint)
    if constraint.think != "none":
        _checked_start(own, constraint, tokenizer)
    grammar = after_think(own, constraint.think)
    matcher = _checked_start(grammar, constraint, tokenizer)
    if constraint.think != "none":
        _build_answer(matcher, constraint, tokenizer)
    return matcher, grammar


def _checked_start(grammar: str, constraint: Constraint, tokenizer: GrammarTokenizer) -> Any:
    """`grammar`'s start state; InvalidArgument or ResourceExhausted naming the constraint's
    field when it does not compile or cannot go on from there."""
    field_name = constraint.field_name()
    matcher = _start_state(grammar, tokenizer)
    if matcher.is_error():
        error = str(matcher.get_error())
        limit_hit = too_complex(field_name, error)
        if limit_hit is not None:
            raise limit_hit
        if constraint.kind == "json_schema":
            raise InvalidArgument(field_name, constraint.text, schemas.reword(error))
        reason = f"does not compile: {' '.join(error.split())[:300]}"
        raise InvalidArgument(field_name, constraint.text, reason)
    dead_end = ConstraintMatcher(matcher, tokenizer, field_name).dead_end()
    if dead_end is not None:
        raise dead_end
    return matcher


def _build_answer(matcher: Any, constraint: Constraint, tokenizer: GrammarTokenizer) -> None:
    """Build the answer's lexer of `matcher` (behind a think block) now, off the decode step and
    where the compile is measured, on a copy moved past the shortest block; deep copies share
    it. They share llguidance's lexer limits too: an answer whose lexer used them up leaves no
    copy able to take even the block, so a fresh copy must still take it: RESOURCE_EXHAUSTED
    naming the field otherwise, not a failure at every request's first token."""
    block = tokenizer.encode(shortest_block(constraint.think))
    answer = matcher.deep_copy()
    if all(answer.consume_token(t) for t in block):
        answer.compute_bitmask()
    probe = matcher.deep_copy()
    if all(probe.consume_token(t) for t in block) and not answer.is_error():
        return
    error = str(probe.get_error() or answer.get_error())
    limit_hit = too_complex(constraint.field_name(), error)
    if limit_hit is not None:
        raise limit_hit
    raise RuntimeError(f"the think block's grammar refused its own block: {error}")


def _start_state(grammar: str, tokenizer: GrammarTokenizer) -> Any:
    limits = llguidance.LLParserLimits(verbose_errors=False)
    matcher = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0, limits=limits)
    if not matcher.is_error():
        # The first mask builds the lexer's start states here, off the decode step, and shows a
        # grammar that trips the parser's limits at its first step.
        matcher.compute_bitmask()
    return matcher


def _add_lanes(
    compiled: CompiledConstraint, grammar: str, config: CompileConfig, first_s: float
) -> None:
    """Compile `compiled`'s other lanes from its `grammar` (the first compiled fine, in
    `first_s`: so do these), unless that would hold the compile thread past another
    timeout_s."""
    if config.lanes == 1 or first_s * (config.lanes - 1) > config.timeout_s:
        return
    for _ in range(config.lanes - 1):
        matcher = _start_state(grammar, compiled.tokenizer)
        if matcher.is_error():  # not expected; the lanes built so far serve
            return
        compiled.lanes.append(matcher)


class ConstraintCompiler:
    """Compiles constraints for one tokenizer, with an LRU cache; thread-safe, loop-friendly."""

    def __init__(self, tokenizer: GrammarTokenizer, config: CompileConfig = CompileConfig()):
        self.tokenizer = tokenizer
        self.config = config
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledConstraint] = OrderedDict()
        self._cached_bytes = 0  # of the constraints in _cache (their num_bytes)
        self._trials = CompileTrials(tokenizer)
        # Constraints the library refused (InvalidArgument: the same text is refused every
        # time): a client repeating a bad schema costs a lookup, not a compile thread each.
        self._refused: OrderedDict[tuple[str, str], InvalidArgument] = OrderedDict()
        self._running: dict[tuple[str, str], _Compile] = {}
        self._num_threads = 0
        self._hits = self._misses = 0

    def stats(self) -> CompileStats:
        with self._lock:
            return CompileStats(self._hits, self._misses, self._num_threads)

    def warm(self) -> None:
        """Start a compile process in the background (services call it at start)."""
        self._trials.warm()

    def close(self) -> None:
        """Stop the compile processes (trial.py); also done when this compiler is collected."""
        self._trials.close()

    def compile_sync(self, constraint: Constraint) -> CompiledConstraint:
        """Blocking compile (for worker threads and tests); the same limits as `compile`."""
        running = self._submit(constraint)
        left = running.left_s(self.config.timeout_s)
        while True:
            try:
                return running.result.result(timeout=max(left, 0.0))
            except concurrent.futures.TimeoutError:
                if running.result.done():  # its own end, be it a TimeoutError: not our wait's
                    return running.result.result()
                left = running.left_s(self.config.timeout_s)
                if left <= 0:
                    raise self._timed_out(constraint) from None

    async def compile(self, constraint: Constraint) -> CompiledConstraint:
        """Compile without blocking the event loop (a cache hit returns at once)."""
        running = self._submit(constraint)
        if running.result.done():
            return running.result.result()
        waited = asyncio.wrap_future(running.result)
        left = running.left_s(self.config.timeout_s)
        while True:
            try:
                # shield: a timed-out waiter must not cancel the compile others may be joining.
                # (asyncio.timeout, not wait_for: 3.11's wait_for can drop the caller's cancel.)
                async with asyncio.timeout(max(left, 0.0)):
                    return await asyncio.shield(waited)
            except TimeoutError:
                if waited.done():  # its own end, be it a TimeoutError: not our wait's
                    return waited.result()
                left = running.left_s(self.config.timeout_s)
                if left <= 0:
                    # Its late end is nobody's now: read, or asyncio logs it as never retrieved.
                    waited.add_done_callback(lambda f: f.cancelled() or f.exception())
                    raise self._timed_out(constraint) from None

    def _timed_out(self, constraint: Constraint) -> ResourceExhausted:
        field_name = constraint.field_name()
        limit = self.config.timeout_s
        return ResourceExhausted(f"{field_name}: compiling the constraint took over {limit} s")

    def _submit(self, constraint: Constraint) -> _Compile:
        validate(constraint)
        key = (self.tokenizer.fingerprint, constraint.key)
        with self._lock:
            refused = self._refused.get(key)
            if refused is not None:
                self._hits += 1
                self._refused.move_to_end(key)
                failed: concurrent.futures.Future[CompiledConstraint] = concurrent.futures.Future()
                failed.set_exception(InvalidArgument.many(refused.violations))
                return _Compile(failed)
            cached = self._cache.get(key)
            if cached is not None:
                self._hits += 1
                self._cache.move_to_end(key)
                done: concurrent.futures.Future[CompiledConstraint] = concurrent.futures.Future()
                done.set_result(cached)
                return _Compile(done)
            running = self._running.get(key)
            if running is not None:
                self._hits += 1  # joins a compile in flight: no second compile
                return running
            if self._num_threads >= self.config.max_compile_threads:
                field_name = constraint.field_name()
                raise ResourceExhausted(
                    f"{field_name}: {self._num_threads} constraints are compiling; retry shortly",
                    retry_after_s=self.config.timeout_s,
                )
            self._misses += 1
            self._num_threads += 1
            running = _Compile(concurrent.futures.Future())
            self._running[key] = running
        thread = threading.Thread(
            target=self._run,
            args=(constraint, key, running),
            name="constraint-compile",
            daemon=True,
        )
        thread.start()
        return running

    def _run(
        self,
        constraint: Constraint,
        key: tuple[str, str],
        running: _Compile,
    ) -> None:
        def asked() -> None:
            running.asked_at = time.monotonic()

        future = running.result
        try:
            tried_bytes = self._trials.run(constraint, self.config, asked)
            # Timed alone: the other lanes are compiles here, not a child's start and trial.
            started = time.perf_counter()
            template, grammar = build(constraint, self.tokenizer)
            first_s = time.perf_counter() - started
        except BaseException as e:
            with self._lock:
                self._running.pop(key, None)
                self._num_threads -= 1
                if isinstance(e, InvalidArgument):
                    self._refused[key] = e
                    while len(self._refused) > self.config.cache_entries:
                        self._refused.popitem(last=False)
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(e)
            return
        field_name = constraint.field_name()
        text_bytes = len(constraint.text) + sum(len(choice) for choice in constraint.choices)
        num_bytes = self.config.lanes * max(tried_bytes, text_bytes)
        compiled = CompiledConstraint(constraint, self.tokenizer, template, field_name, num_bytes)
        with self._lock:
            self._running.pop(key, None)
            self._cache[key] = compiled
            self._cached_bytes += num_bytes
            while len(self._cache) > 1 and (
                len(self._cache) > self.config.cache_entries
                or self._cached_bytes > self.config.cache_bytes
            ):  # the least recently used go first; the newest stays, however large
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.num_bytes
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # nobody waits now
            future.set_result(compiled)
        try:  # the thread still counts against max_compile_threads meanwhile
            _add_lanes(compiled, grammar, self.config, first_s)
        except Exception:  # not expected (the first lane compiled); its lanes so far serve
            _LOG.exception("compiling another lane of %s failed", field_name)
        finally:
            with self._lock:
                self._num_threads -= 1


def load_compiler(
    model_dir: Path,
    vocab_rows: int,
    eos_token_ids: Collection[int],
    config: CompileConfig = CompileConfig(),
) -> ConstraintCompiler | None:
    """Prefill's and decode's compiler, built once at start (about a second for a Qwen3-sized
    vocabulary): over the checkpoint's tokenizer.json, the model's `vocab_rows` and EOS ids.
    None (logged) when the directory has no tokenizer.json or no EOS id, or llguidance cannot
    read the tokenizer: the service still starts, and constrained requests are refused
    (`compile_for`)."""
    path = model_dir / "tokenizer.json"
    if not path.exists() or not eos_token_ids:
        _LOG.warning("%s: no tokenizer.json or EOS id: constraints are refused", model_dir)
        return None
    try:
        tokenizer = GrammarTokenizer.from_file(path, vocab_rows, sorted(eos_token_ids))
    except (ValueError, OSError) as e:  # llguidance's own reading of the file included
        _LOG.warning("%s: constraints are refused: tokenizer.json: %s", model_dir, e)
        return None
    compiler = ConstraintCompiler(tokenizer, config)
    compiler.warm()
    return compiler


async def compile_for(
    compiler: ConstraintCompiler | None, constraint: Constraint | None
) -> CompiledConstraint | None:
    """A request's constraint compiled (None for none) off the event loop: a cache hit after
    the first request with it. FailedPrecondition when this instance has no compiler."""
    if constraint is None:
        return None
    if compiler is None:
        field_name = constraint.field_name()
        raise FailedPrecondition(
            f"{field_name}: this instance has no tokenizer.json to compile constraints with"
        )
    return await compiler.compile(constraint)
