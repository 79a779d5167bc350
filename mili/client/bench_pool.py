"""`mili bench --processes P`: one run's clients in P processes of their own.

One Python process reads only so many streamed messages a second (grpc's work per message under
one GIL: docs/benchmarks.md, "mili bench's own CPU"), so a deployment that streams more than
that would be measured at the client's rate. Each process (spawned: grpc does not survive a
fork) opens its own connections to the frontends that answered Info and runs part k of the run
(`bench_clients.drive`: requests i with i % P == k, over its share of the clients); every
process starts its clock once all of them are connected (a barrier), so the run's wall time is
the first start to the last end. Finished requests come back on one queue as they end, for
the progress line printed here, and each process's results, times and CPU when it is done;
then it exits at once (`_report_and_exit`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import queue as queue_module
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from mili.client.bench_clients import CONNECT_TIMEOUT_S, ClientRun, NotConnected, drive
from mili.client.bench_report import Progress, RequestResult

if TYPE_CHECKING:
    from mili.rpc.tls import Tls

# How long a connected process waits for the others: their start (a Python with grpc and the
# protos to import) and their connections (each bounded by CONNECT_TIMEOUT_S).
START_TIMEOUT_S = 60.0 + CONNECT_TIMEOUT_S


def run(
    args: argparse.Namespace,
    tls: Tls | None,
    addresses: list[str],
    num_processes: int,
    progress: Progress,
) -> list[ClientRun]:
    """Every process's run, in part order. NotConnected when one's connections did not come
    up; RuntimeError when one failed otherwise or died. On any way out (Ctrl-C included) the
    processes still running are terminated."""
    context = multiprocessing.get_context("spawn")
    messages: Any = context.Queue()
    barrier = context.Barrier(num_processes)
    processes = [
        context.Process(
            target=_client,
            args=(args, tls, addresses, k, num_processes, barrier, messages),
            name=f"mili-bench-{k}",
            daemon=True,
        )
        for k in range(num_processes)
    ]
    with _main_not_imported_again():
        for process in processes:
            process.start()
    runs: dict[int, ClientRun] = {}
    num_started = 0
    suspects: set[int] = set()  # dead without results at the last quiet second
    try:
        while len(runs) < num_processes:
            try:
                kind, part, payload = messages.get(timeout=1.0)
            except queue_module.Empty:
                if num_started == num_processes:
                    progress.tick()
                dead = {
                    k for k, p in enumerate(processes) if k not in runs and p.exitcode is not None
                }
                # A process that put its results and exited may be read a second later: one
                # quiet second more before calling it dead.
                if dead & suspects:
                    k = min(dead & suspects)
                    raise RuntimeError(
                        f"client process {k} exited {processes[k].exitcode} without its results"
                    ) from None
                suspects = dead
                continue
            if kind == "started":
                num_started += 1
                if num_started == num_processes:
                    progress.start()
            elif kind == "result":
                progress.record(payload)
            elif kind == "run":
                runs[part] = payload
            elif kind == "not_connected":
                raise NotConnected(payload)
            elif kind == "failed":
                raise RuntimeError(f"client process {part}: {payload}")
            # "aborted": another process broke the barrier; its own message says why
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(5.0)
        messages.close()
    return [runs[k] for k in range(num_processes)]


@contextlib.contextmanager
def _main_not_imported_again() -> Iterator[None]:
    """While the processes start: spawn has each child import this process's __main__ again
    (so that targets defined there unpickle); ours is a module's function, and a benchmark
    script's imports (torch among them, seconds each) would only delay every child."""
    main = sys.modules["__main__"]
    saved: dict[str, Any] = {
        k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__
    }
    main.__dict__.update(dict.fromkeys(saved))  # None: multiprocessing leaves main alone
    try:
        yield
    finally:
        main.__dict__.update(saved)


def _client(
    args: argparse.Namespace,
    tls: Tls | None,
    addresses: list[str],
    part: int,
    num_parts: int,
    barrier: Any,
    messages: Any,
) -> None:
    """A client process: its part of the run, reported on `messages` as (kind, part, payload)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent terminates us

    async def ready() -> None:
        await asyncio.to_thread(barrier.wait, START_TIMEOUT_S)
        messages.put(("started", part, None))

    def record(result: RequestResult) -> None:
        # What the progress line needs; the whole result comes with the run.
        light = RequestResult(
            num_completion_tokens=result.num_completion_tokens, error=result.error
        )
        messages.put(("result", part, light))

    async def part_of_the_run() -> None:
        try:
            run = await drive(
                args,
                tls,
                addresses,
                part=part,
                num_parts=num_parts,
                on_result=record,
                ready=ready,
            )
        except threading.BrokenBarrierError:
            _report_and_exit(messages, ("aborted", part, None), 1)
        except NotConnected as err:
            _report_and_exit(messages, ("not_connected", part, str(err)), 1, barrier)
        except BaseException as err:  # reported to the parent, which raises it
            message = ("failed", part, f"{type(err).__name__}: {err}")
            _report_and_exit(messages, message, 1, barrier)
        _report_and_exit(messages, ("run", part, run), 0)

    asyncio.run(part_of_the_run())


def _report_and_exit(
    messages: Any, message: tuple[str, int, Any], code: int, barrier: Any = None
) -> NoReturn:
    """Put the process's last message, wait until it is written to the pipe (then break the
    `barrier` the others may wait at: they stop, the parent has the reason first), and exit at
    once: nothing of this process is needed once its results are out, and skipping the
    interpreter's teardown (the event loop's, grpc's threads') leaves no window for it to
    fail after them."""
    messages.put(message)
    messages.close()
    messages.join_thread()  # the queue's feeder thread has written everything
    if barrier is not None:
        barrier.abort()
    os._exit(code)
