"""`mili serve` supervises its children: one killed with SIGKILL is restarted on the same
address while the others keep serving, and takes work again; one that cannot start backs off
(0.5 s, 1 s, 2 s, ...) instead of spinning, and comes back once it can; --fail-fast keeps the
old fail-stop behaviour; a frontend of several comes back on the port they share."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from mili.rpc.client import channel_options
from tests.service_process import ServiceProcess, counted

_CHILD = re.compile(r"mili serve: (\S+)\s+(\S+) pid (\d+)")
_DONE = re.compile(r"\[frontend\] .* (\S+) done: prefill \S+ -> decode (\S+),")
_RESTART = re.compile(r"mili serve: (\S+) \(pid \d+\) exited with code (-?\d+).* in ([\d.]+) s")
_TAIL_LINE = re.compile(r"^    \d\d:\d\d:\d\d\.\d{3} ")


@dataclass(frozen=True)
class Children:
    addresses: dict[str, str]  # "decode-1" -> "127.0.0.1:41235"
    pids: dict[str, int]


def start_serve(model_dir: Path, *extra: str) -> tuple[ServiceProcess, Children]:
    serve = ServiceProcess(
        "serve", "--model", str(model_dir), "--port", "0",
        "--prefill-args", "--num-blocks 256", "--decode-args", "--num-blocks 256",
        "--frontend-args", "--poll-interval 0.5", *extra,
        timeout_s=180,
    )  # fmt: skip
    found = [m for line in serve.stdout_lines if (m := _CHILD.match(line))]
    children = Children({m[1]: m[2] for m in found}, {m[1]: int(m[3]) for m in found})
    return serve, children


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, serve: ServiceProcess) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(
                f"{what} not within {timeout_s} s; mili serve said:\n{serve.stderr[-6000:]}"
            )
        time.sleep(0.1)


def index_of(lines: list[str], text: str, start: int = 0) -> int | None:
    return next((i for i in range(start, len(lines)) if text in lines[i]), None)


@dataclass
class Outcome:
    request_id: str
    started: float
    finished: float
    error: str | None  # None: it finished with all its tokens


@dataclass
class Load:
    """Workers sending one Generate after another until stopped."""

    address: str
    num_workers: int = 3
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._work, args=(k,), daemon=True)
            for k in range(self.num_workers)
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _work(self, k: int) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            n = 0
            while not self._stop.is_set():
                request_id = f"load-{k}-{n}"
                n += 1
                started = time.monotonic()
                request = generation_pb2.GenerateRequest(
                    request_id=request_id,
                    prompt="Hello there",
                    sampling=sampling_pb2.SamplingParams(
                        max_tokens=24, temperature=0, ignore_eos=True
                    ),
                )
                try:
                    replies = list(stub.Generate(request, timeout=60))
                    error = None if replies[-1].usage.completion_tokens == 24 else "short"
                except grpc.RpcError as err:
                    error = f"{err.code().name}: {err.details()}"
                self.outcomes.append(Outcome(request_id, started, time.monotonic(), error))

    def num_ok(self) -> int:
        return sum(o.error is None for o in self.outcomes)


@pytest.fixture(scope="module")
def served(demo_model_dir: Path) -> Iterator[tuple[ServiceProcess, Children]]:
    """Two decode instances behind one frontend."""
    serve, children = start_serve(demo_model_dir, "--decode-instances", "2")
    yield serve, children
    assert serve.terminate(timeout_s=90) == 0, serve.stderr[-3000:]


def test_a_killed_decode_is_restarted_while_the_others_keep_serving(
    served: tuple[ServiceProcess, Children],
) -> None:
    serve, children = served
    victim, address = children.pids["decode-1"], children.addresses["decode-1"]
    load = Load(serve.address)
    load.start()
    try:
        wait_for("6 requests", lambda: load.num_ok() >= 6, 60, serve)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        back = f"mili serve: decode-1 is back on {address}"
        wait_for("the restart", lambda: index_of(serve.stderr_lines, back) is not None, 120, serve)
        back_at = time.monotonic()
        back_line = index_of(serve.stderr_lines, back)
        assert back_line is not None

        def routed_to_it_again() -> bool:
            later = serve.stderr_lines[back_line:]
            return any((m := _DONE.search(line)) and m[2] == address for line in later)

        wait_for("a request on the restarted decode-1", routed_to_it_again, 30, serve)
    finally:
        load.stop()

    # Only requests that were on decode-1 when it died failed; all others, before, during the
    # outage and after, got every token.
    failed = [o for o in load.outcomes if o.error is not None]
    # Each failure's start relative to the kill (and to the restart) and the end of its error.
    seen = [
        (o.request_id, round(o.started - killed_at, 3), round(o.started - back_at, 3), o.error)
        for o in failed
    ]
    assert len(failed) <= load.num_workers, (seen, serve.stderr[-8000:])
    for outcome in failed:
        assert outcome.error is not None and address in outcome.error, outcome
        assert outcome.started < killed_at, outcome
    during = [o for o in load.outcomes if killed_at < o.started and o.finished < back_at]
    assert during and all(o.error is None for o in during)

    # The event: its exit, where it restarts and when, then this run's log lines, timed.
    lines = serve.stderr_lines
    died = index_of(lines, f"mili serve: decode-1 (pid {victim}) exited with code -9 (SIGKILL)")
    assert died is not None, serve.stderr[-3000:]
    assert f"restarting it on {address} in 0.5 s" in lines[died]
    tail = []
    for line in lines[died + 1 :]:
        if not _TAIL_LINE.match(line):
            break
        tail.append(line)
    assert tail and f"decode service listening on {address}" in tail[-1]
    assert sum("decode service listening" in line for line in tail) == 1  # this run's only


def test_a_child_that_cannot_start_backs_off_and_comes_back(
    served: tuple[ServiceProcess, Children],
) -> None:
    serve, children = served
    address = children.addresses["decode-0"]
    port = int(address.rpartition(":")[2])
    pid = children.pids["decode-0"]
    start = len(serve.stderr_lines)
    os.kill(pid, signal.SIGKILL)
    # Hold its port (as a stray process would) so that every restart fails at once.
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + 10
    while True:
        try:
            holder.bind(("127.0.0.1", port))
            break
        except OSError:  # still dying
            assert time.monotonic() < deadline
            time.sleep(0.01)
    holder.listen()
    try:

        def restarts() -> list[re.Match[str]]:
            found = (_RESTART.search(line) for line in serve.stderr_lines[start:])
            return [m for m in found if m and m[1] == "decode-0"]

        wait_for("3 failed restarts", lambda: len(restarts()) >= 4, 60, serve)
        # The peers kept serving meanwhile.
        with grpc.insecure_channel(serve.address) as channel:
            reply = list(
                generation_pb2_grpc.GenerationServiceStub(channel).Generate(
                    generation_pb2.GenerateRequest(
                        prompt="Hi", sampling=sampling_pb2.SamplingParams(max_tokens=4)
                    ),
                    timeout=60,
                )
            )
            assert reply[-1].usage.completion_tokens >= 1
    finally:
        holder.close()
    found = restarts()
    assert [m[2] for m in found[:4]] == ["-9", "2", "2", "2"]  # SIGKILL, then StartupError
    assert [float(m[3]) for m in found[:4]] == [0.5, 1.0, 2.0, 4.0]
    failed_run = index_of(serve.stderr_lines, "mili serve: decode-0", start + 1)
    assert failed_run is not None
    assert any("is already in use" in line for line in serve.stderr_lines[failed_run:])
    back = f"mili serve: decode-0 is back on {address}"
    wait_for(
        "decode-0 back", lambda: index_of(serve.stderr_lines, back, start) is not None, 120, serve
    )


def test_fail_fast_stops_everything_when_a_child_dies(demo_model_dir: Path) -> None:
    serve, children = start_serve(demo_model_dir, "--fail-fast")
    try:
        os.kill(children.pids["decode-0"], signal.SIGKILL)
        code = serve.proc.wait(timeout=60)
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()
    assert code == 1
    assert f"decode-0 (pid {children.pids['decode-0']}) exited with code -9" in serve.stderr
    assert "stopping the others (--fail-fast)" in serve.stderr
    assert "restarting" not in serve.stderr


def test_a_killed_frontend_comes_back_on_the_public_port(
    served: tuple[ServiceProcess, Children],
) -> None:
    serve, children = served
    assert children.addresses["frontend"] == serve.address
    start = len(serve.stderr_lines)
    os.kill(children.pids["frontend"], signal.SIGKILL)
    back = f"mili serve: frontend is back on {serve.address}"
    wait_for(
        "the frontend back",
        lambda: index_of(serve.stderr_lines, back, start) is not None,
        60,
        serve,
    )
    # Clients of the public address need nothing new: the same address answers again.
    with grpc.insecure_channel(serve.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            prompt="Hi", sampling=sampling_pb2.SamplingParams(max_tokens=4, temperature=0)
        )
        deadline = time.monotonic() + 20  # its first Info poll may still be on its way
        while True:
            try:
                replies = list(stub.Generate(request, timeout=30))
                break
            except grpc.RpcError as err:
                assert time.monotonic() < deadline, err
                time.sleep(0.2)
    assert replies[-1].usage.completion_tokens >= 1


def _generate_once(address: str) -> int:
    """One Generate over a connection of its own (one of the processes behind a shared port)."""
    with grpc.insecure_channel(address, options=channel_options(own_connection=True)) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            prompt="Hi", sampling=sampling_pb2.SamplingParams(max_tokens=2, ignore_eos=True)
        )
        return list(stub.Generate(request, timeout=30))[-1].usage.completion_tokens


def test_a_killed_frontend_of_several_comes_back_on_the_shared_port(demo_model_dir: Path) -> None:
    """`--frontends 2` share one port: while one is dead the other takes every new connection,
    and the restarted one joins the port again and takes its share."""
    serve, children = start_serve(demo_model_dir, "--frontends", "2", "--metrics-port", "0")
    try:
        shared = serve.address
        assert children.addresses["frontend-0"] == children.addresses["frontend-1"] == shared
        metrics = re.search(r"frontend-1 .* metrics (\S+)", "".join(serve.stdout_lines))
        assert metrics, serve.stdout_lines
        start = len(serve.stderr_lines)
        os.kill(children.pids["frontend-1"], signal.SIGKILL)
        wait_for(
            "frontend-1's exit reported",
            lambda: index_of(serve.stderr_lines, "frontend-1 (pid", start) is not None,
            30,
            serve,
        )
        assert [_generate_once(shared) for _ in range(8)] == [2] * 8  # frontend-0 alone
        back = f"mili serve: frontend-1 is back on {shared}"
        wait_for(
            "frontend-1 back",
            lambda: index_of(serve.stderr_lines, back, start) is not None,
            60,
            serve,
        )

        # its first Info poll may still be on its way: retry each until it answers
        deadline = time.monotonic() + 30
        # a new process: its counters start at 0
        while counted(metrics.group(1), "mili_requests_total", grpc_method="Generate") == 0:
            assert time.monotonic() < deadline, "no connection reached frontend-1 again"
            with contextlib.suppress(grpc.RpcError):
                _generate_once(shared)
    finally:
        assert serve.terminate(timeout_s=90) == 0, serve.stderr[-3000:]
