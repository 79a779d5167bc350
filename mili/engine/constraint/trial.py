"""A constraint's first compile, tried in a child process that can be killed.

llguidance cannot be interrupted, and a few tiny grammars never finish their first mask
(`start: A B`, `A: /a+/`, `B: /a/`: none of its fuel limits stops it, and its memory grows all
the while); others finish only after hundreds of megabytes (the regex `b{1000}{900}`). On a
thread of the service, such a compile held a compile slot and the memory for good: four of
them refused every new constraint until a restart. So a constraint the cache does not hold is
compiled first in a child process, the whole of it (grammar text, matcher, first mask, the
dead-end check), and killed there once it runs past the time limit or its memory past
`max_compile_bytes`; only one that compiled there within both is compiled again in the service,
where its matcher is used (as fast: the same tokenizer and the same code). The child reports
what the compile grew its memory by, which weighs the constraint in the cache.

    ConstraintCompiler thread            child (python -m mili.engine.constraint.trial)
    start: tokenizer.json, rows, EOS ──▶ builds its GrammarTokenizer once, answers "ready"
    constraint                       ──▶ compiler.build -> ("ok", bytes grown)
                                         | ("invalid", violations) | ("exhausted", message)
    no answer in timeout_s, or its resident memory grown past max_compile_bytes: killed; the
    next trial starts another

Children start on the first compile that needs one (or at `warm`), one per compile running at
once (at most CompileConfig.max_compile_threads); those beyond one stop after IDLE_S unused
(each holds its own tokenizer: ~155 MB for Qwen3's). All are started by one thread of the
compiler's, and ask Linux to kill them when that thread ends (PR_SET_PDEATHSIG): a child stuck
in a compile dies with its service however the service dies, and with its compiler when that
is closed or collected.
Messages are length-prefixed pickles on the child's stdin and stdout: both ends are this module.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from mili.errors import FieldViolation, InvalidArgument, ResourceExhausted, Unavailable

if TYPE_CHECKING:
    from mili.engine.constraint.compiler import CompileConfig
    from mili.engine.constraint.spec import Constraint
    from mili.engine.constraint.vocab import GrammarTokenizer

_LOG = logging.getLogger("mili.engine")
_LENGTH = struct.Struct("<Q")
# A child's start (Python, llguidance, the tokenizer: a second or so for Qwen3's) is not the
# constraint's time: it has a bound of its own.
START_TIMEOUT_S = 60.0
_POLL_S = 0.05  # how often the parent reads a compiling child's memory
# How long a child beyond the first stays unused before it is stopped: a burst of distinct new
# constraints keeps its children (a start costs a second or so), a quiet service holds one.
IDLE_S = 60.0
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


class CompileTrials:
    """The child processes a compiler tries its first compiles in; thread-safe."""

    def __init__(self, tokenizer: GrammarTokenizer) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._idle: list[tuple[_Child, float]] = []  # with when each was last used
        self._is_reap_due = False  # a timer will look for unused children (_reap)
        # The one thread every child is started from: they die when it ends (module docstring).
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, "constraint-trial-start")

    def warm(self) -> None:
        """Start a child now, in the background, so the first constraint does not wait for it
        (a second or so for a Qwen3-sized vocabulary)."""

        def start() -> None:
            try:
                self._give_back(self._spawn().start(self._tokenizer))
            except Exception as e:
                _LOG.warning("starting a constraint compile process failed: %s", e)

        threading.Thread(target=start, name="constraint-trial-warm", daemon=True).start()

    def run(
        self,
        constraint: Constraint,
        config: CompileConfig,
        on_asked: Callable[[], None] = lambda: None,
    ) -> int:
        """Compile `constraint` in a child: the memory it took, or the InvalidArgument /
        ResourceExhausted the compile raised, or ResourceExhausted naming the field when it
        ran past the time or memory limit (the child is then killed); Unavailable when no child
        could start. `on_asked` is called as the constraint goes to a started child, where its
        time limit starts."""
        field_name = constraint.field_name()
        try:
            child = self._take()
        except (OSError, EOFError, RuntimeError) as e:  # TimeoutError is an OSError
            # Not the constraint's fault: its caller waited for the start (compiler.py).
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise Unavailable(
                f"{field_name}: no constraint compile process could start ({why})"
            ) from None
        on_asked()
        try:
            answer = child.ask(constraint, config.timeout_s, config.max_compile_bytes)
        except TimeoutError:
            child.kill()
            raise ResourceExhausted(
                f"{field_name}: compiling the constraint took over {config.timeout_s} s"
            ) from None
        except MemoryError:
            child.kill()
            limit_mb = config.max_compile_bytes / (1 << 20)
            raise ResourceExhausted(
                f"{field_name}: compiling the constraint takes over {limit_mb:g} MiB of memory"
            ) from None
        except EOFError:
            code = child.kill()
            raise ResourceExhausted(
                f"{field_name}: the constraint's compile process ended (exit code {code})"
            ) from None
        self._give_back(child)
        return _result(answer, field_name, config)

    @property
    def num_idle(self) -> int:
        """Children started and waiting for a compile."""
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        with self._lock:
            children, self._idle = self._idle, []
        for child, _ in children:
            child.kill()
        self._spawner.shutdown(wait=False)  # its thread ends: running children die with it

    def _give_back(self, child: _Child) -> None:
        """Keep `child` for the next compile; the idle ones a burst of compiles started stop
        once they have waited IDLE_S unused (one always stays): checked now and, while more
        than one waits, again a little after IDLE_S (a quiet service compiles nothing more)."""
        with self._lock:
            self._idle.append((child, time.monotonic()))
        self._reap()

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [c for c, used_at in self._idle[:-1] if now - used_at > IDLE_S]
            self._idle = [(c, at) for c, at in self._idle if c not in stale]
            recheck = len(self._idle) > 1 and not self._is_reap_due
            self._is_reap_due = self._is_reap_due or recheck
        for old in stale:
            old.kill()
        if recheck:
            timer = threading.Timer(IDLE_S + 1.0, self._reap_due)
            timer.daemon = True
            timer.start()

    def _reap_due(self) -> None:
        with self._lock:
            self._is_reap_due = False
        self._reap()

    def _take(self) -> _Child:
        with self._lock:
            if self._idle:
                return self._idle.pop()[0]  # the most recently used
        return self._spawn().start(self._tokenizer)

    def _spawn(self) -> _Child:
        return self._spawner.submit(_Child).result()


def _result(answer: Any, field_name: str, config: CompileConfig) -> int:
    kind, *rest = answer
    if kind == "invalid":
        raise InvalidArgument.many([FieldViolation(f, d) for f, d in rest[0]])
    if kind == "exhausted":
        raise ResourceExhausted(rest[0])
    (num_bytes,) = rest
    if num_bytes > config.max_compile_bytes:  # grown past the limit between two polls
        limit_mb = config.max_compile_bytes / (1 << 20)
        raise ResourceExhausted(
            f"{field_name}: compiling the constraint takes over {limit_mb:g} MiB of memory"
        )
    return int(num_bytes)


class _Child:
    """One child process: started, asked one constraint at a time, killed."""

    def __init__(self) -> None:
        """The process, on the spawner's thread (a fork and exec: quick); `start` then waits
        for it to be ready on the caller's, so several start at once."""
        self._process = subprocess.Popen(
            [sys.executable, "-m", "mili.engine.constraint.trial", str(threading.get_native_id())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def start(self, tokenizer: GrammarTokenizer) -> _Child:
        """Hand it the tokenizer and wait until it is ready (killed if it fails)."""
        try:
            start = (tokenizer.source, tokenizer.vocab_rows, tokenizer.eos_token_ids)
            answer = self.ask(start, START_TIMEOUT_S, max_bytes=None)
        except BaseException:
            self.kill()
            raise
        if answer != "ready":
            self.kill()
            raise RuntimeError(f"a constraint compile process did not start: {answer!r}")
        return self

    def ask(self, message: object, timeout_s: float, max_bytes: int | None) -> Any:
        """Send `message`, return the answer. TimeoutError past `timeout_s`, MemoryError once
        the child's resident memory grew by more than `max_bytes` meanwhile, EOFError when it
        died."""
        assert self._process.stdin is not None and self._process.stdout is not None
        _write(self._process.stdin, message)
        baseline = _rss_bytes(self._process.pid)
        deadline = time.monotonic() + timeout_s
        reader = _Reader(self._process.stdout.fileno())
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            answer = reader.read(min(left, _POLL_S))
            if answer is not _Reader.PENDING:
                return answer
            if max_bytes is not None and _rss_bytes(self._process.pid) - baseline > max_bytes:
                raise MemoryError

    def kill(self) -> int | None:
        """Kill the process (if it still runs) and reap it; its exit code."""
        self._process.kill()
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                stream.close()
        return self._process.wait()


class _Reader:
    """Reads one length-prefixed message from a pipe, in as many calls as it takes."""

    PENDING = object()

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = bytearray()
        self._size: int | None = None

    def read(self, timeout_s: float) -> Any:
        """The message, or PENDING when it did not all come within `timeout_s`; EOFError at
        the end of the pipe."""
        ready, _, _ = select.select([self._fd], [], [], timeout_s)
        if not ready:
            return _Reader.PENDING
        need = _LENGTH.size if self._size is None else self._size
        chunk = os.read(self._fd, max(need - len(self._buffer), 1 << 16))
        if not chunk:
            raise EOFError
        self._buffer += chunk
        if self._size is None and len(self._buffer) >= _LENGTH.size:
            (self._size,) = _LENGTH.unpack_from(self._buffer)
            del self._buffer[: _LENGTH.size]
        if self._size is not None and len(self._buffer) >= self._size:
            return pickle.loads(bytes(self._buffer[: self._size]))
        return _Reader.PENDING


def _write(stream: IO[bytes], message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _read_blocking(stream: IO[bytes]) -> Any:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        raise EOFError
    (size,) = _LENGTH.unpack(header)
    return pickle.loads(stream.read(size))


def _rss_bytes(pid: int) -> int:
    """A process's resident memory (Linux /proc); 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0


# ---- the child ------------------------------------------------------------------------------


def _die_with(starter_tid: int) -> None:
    """SIGKILL when the parent's thread that started us ends (Linux): a compile that never ends
    holds the GIL-free Rust code, so nothing in this process could notice by itself. If that
    thread already ended, our parent is another process now: exit."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except AttributeError:  # not Linux
        return
    if not os.path.exists(f"/proc/{os.getppid()}/task/{starter_tid}"):
        os._exit(1)


def _serve() -> None:
    _die_with(int(sys.argv[1]))
    # compiler imports this module: the child's half imports it when it runs.
    from mili.engine.constraint.compiler import build
    from mili.engine.constraint.spec import Constraint
    from mili.engine.constraint.vocab import GrammarTokenizer

    channel_in, channel_out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # the pipe is the channel: nothing else may write to it
    source, vocab_rows, eos_token_ids = _read_blocking(channel_in)
    tokenizer = GrammarTokenizer(source, vocab_rows, eos_token_ids)
    # A first compile sets up what llguidance builds once (~0.7 MB): not a constraint's size.
    build(Constraint.regex("a"), tokenizer)
    _write(channel_out, "ready")
    trim = _malloc_trim()
    while True:
        try:
            constraint = _read_blocking(channel_in)
        except EOFError:
            return
        before = _rss_bytes(os.getpid())
        answer: tuple[Any, ...]
        try:
            matcher, _ = build(constraint, tokenizer)
            answer = ("ok", max(_rss_bytes(os.getpid()) - before, 0))
            del matcher
        except InvalidArgument as e:
            answer = ("invalid", [(v.field, v.description) for v in e.violations])
        except ResourceExhausted as e:
            answer = ("exhausted", str(e))
        _write(channel_out, answer)
        trim(0)


def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim
    except AttributeError:  # not glibc
        return lambda *_: 0


if __name__ == "__main__":
    _serve()
