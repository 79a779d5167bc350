"""`mili bench` against a fake frontend on a real server: it sends a request refused with
RESOURCE_EXHAUSTED + RetryInfo again after the hinted delay, skips an address where nothing
listens, and splits a run over client processes (--processes) without losing or repeating a
request."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mili.client.bench import add_arguments, bench
from mili.client.bench_report import report
from mili.errors import ResourceExhausted
from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from mili.ports import pick_free
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig

SERVICE = "mili.frontend.v1.GenerationService"
RETRY_AFTER_S = 0.2


class BusyFrontend(generation_pb2_grpc.GenerationServiceServicer):
    """Refuses its first `num_refusals` Generate calls as a full frontend does, then streams."""

    def __init__(self, num_refusals: int, stall_s: float = 0.0) -> None:
        self.num_refusals = num_refusals
        self.stall_s = stall_s  # > 0: 200 tokens a message each, the first request stalling once
        self.sent_at: list[float] = []  # when each Generate call came
        self.request_ids: list[str] = []  # of each Generate call, in order

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.sent_at.append(time.monotonic())
        self.request_ids.append(request.request_id)
        if len(self.sent_at) <= self.num_refusals:
            raise ResourceExhausted("the frontend is running its limit", RETRY_AFTER_S)
        if self.stall_s:
            for i in range(200):
                if i == 100 and request.request_id == "bench-0":
                    await asyncio.sleep(self.stall_s)
                yield generation_pb2.GenerateResponse(token_ids=[i])
                await asyncio.sleep(0.001)
        yield generation_pb2.GenerateResponse(token_ids=[1, 2])
        yield generation_pb2.GenerateResponse(
            token_ids=[3],
            finish_reason=sampling_pb2.FINISH_REASON_LENGTH,
            usage=generation_pb2.Usage(prompt_tokens=4, completion_tokens=3),
        )

    async def Info(self, request: Any, context: Any) -> Any:
        return generation_pb2.InfoResponse(model="fake")


def _args(address: str, *more: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    fixed = ["--num-requests", "2", "--prompt-tokens", "4", "--timeout", "10"]
    return parser.parse_args(["--address", address, *fixed, *more])


async def _bench(
    num_refusals: int, *more: str, stall_s: float = 0.0
) -> tuple[dict[str, Any], BusyFrontend, str]:
    frontend = BusyFrontend(num_refusals, stall_s)
    server = RpcServer(ServerConfig(drain_timeout_s=1.0, grace_s=0.1), name="frontend")
    server.add_service(
        SERVICE, lambda s: generation_pb2_grpc.add_GenerationServiceServicer_to_server(frontend, s)
    )
    await server.start()
    dead = f"127.0.0.1:{pick_free('127.0.0.1')}"  # nothing listens there
    try:
        args = _args(f"{dead},{server.address}", "--concurrency", "2", *more)
        # On a loop of its own: with --processes the run blocks its loop, and this one serves.
        run = asyncio.to_thread(asyncio.run, bench(args))
        summary = await asyncio.wait_for(run, 60)
    finally:
        await server.drain()
    return summary, frontend, dead


def test_a_refusal_with_retry_info_is_sent_again_after_its_delay_and_a_dead_address_skipped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    summary, frontend, dead = asyncio.run(_bench(2))
    assert (summary["num_ok"], summary["num_errors"]) == (2, 0)
    assert (summary["num_retries"], summary["num_retried_requests"]) == (2, 2)
    assert len(frontend.sent_at) == 4  # both requests went to the live address
    first, second = sorted(frontend.sent_at[:2]), sorted(frontend.sent_at[2:])
    assert second[0] - first[0] >= RETRY_AFTER_S * 0.9  # waited the hinted delay
    # TTFT counts from the first send, backoff included.
    assert summary["ttft"]["p50_ms"] >= RETRY_AFTER_S * 1e3 * 0.9
    (skipped,) = summary["skipped_addresses"]
    assert skipped["address"] == dead and skipped["error"].startswith("UNAVAILABLE: ")
    assert f"mili bench: skipping {dead}: UNAVAILABLE: " in capsys.readouterr().err
    lines = report(summary).splitlines()
    assert "retries    2 (of 2 requests refused RESOURCE_EXHAUSTED with RetryInfo, sent " in (
        "\n".join(lines)
    )
    assert f"skipped    {dead}: UNAVAILABLE: " in "\n".join(lines)


def test_the_report_gives_the_longest_gap_that_p99_hides() -> None:
    """One stall among ~400 gaps (a preempted request's recompute holding every stream) is
    above p99: only the max shows it."""
    stall_s = 0.4
    summary, _, _ = asyncio.run(_bench(0, "--output-tokens", "203", stall_s=stall_s))
    itl = summary["itl"]
    assert itl["max_ms"] >= stall_s * 1e3 and itl["p99_ms"] < stall_s * 1e3 / 2
    assert summary["latency"]["max_ms"] >= stall_s * 1e3
    (line,) = [x for x in report(summary).splitlines() if x.startswith("itl ")]
    assert line.endswith(f"max {itl['max_ms']:.2f} ms")


def test_retries_are_bounded() -> None:
    summary, frontend, _ = asyncio.run(_bench(100, "--max-retries", "1"))
    assert (summary["num_ok"], summary["num_errors"]) == (0, 2)
    assert summary["num_retries"] == 2 and len(frontend.sent_at) == 4
    (group,) = summary["errors"]
    error = "RESOURCE_EXHAUSTED: the frontend is running its limit"
    assert group == {"cause": error, "count": 2, "error": error}


def test_connections_default_to_one_a_client_over_the_addresses_and_must_be_positive(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mili.client.bench import run

    summary, _, _ = asyncio.run(_bench(0, "--concurrency", "6"))
    assert summary["config"]["connections"] == 6  # 6 clients over the 1 address that answered
    summary, _, _ = asyncio.run(_bench(0, "--connections", "1"))
    assert (summary["config"]["connections"], summary["num_ok"]) == (1, 2)
    assert run(_args("127.0.0.1:1", "--connections", "0")) == 2
    assert "--connections must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("processes", [1, 2])
def test_connections_a_frontend_never_answers_fail_the_run_with_a_message(
    processes: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A process on the shared port that accepts connections but never speaks (a hung sibling
    frontend): the run stops before its clock starts, saying which address; with client
    processes, the one whose connections hang says it and the others stop at their barrier
    (their connect timeout is the module's own, 10 s: the patch does not reach them)."""
    import socket

    import mili.client.bench as bench_module
    import mili.client.bench_clients as clients_module

    monkeypatch.setattr(clients_module, "CONNECT_TIMEOUT_S", 1.0)
    server = RpcServer(ServerConfig(reuse_port=True, grace_s=0), name="frontend")
    frontend = BusyFrontend(0)
    server.add_service(
        SERVICE, lambda s: generation_pb2_grpc.add_GenerationServiceServicer_to_server(frontend, s)
    )
    hung = socket.socket()
    answered_info = bench_module._live

    async def then_a_hung_sibling(*args: Any) -> Any:
        found = await answered_info(*args)  # Info reached the real frontend
        hung.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        hung.bind(("127.0.0.1", server.port))
        hung.listen(64)  # the kernel completes handshakes; nothing answers HTTP/2
        return found

    monkeypatch.setattr(bench_module, "_live", then_a_hung_sibling)

    async def main() -> int:
        await server.start()
        try:
            # 16 connections all on the live server: probability 2**-16
            args = _args(server.address, "--concurrency", "16", "--processes", str(processes))
            return await asyncio.to_thread(bench_module.run, args)
        finally:
            await server.drain()
            hung.close()

    assert asyncio.run(main()) == 1
    err = capsys.readouterr().err
    assert f"mili bench: {server.address}: " in err, err
    if processes == 1:
        assert "of 16 connections not ready within 1 s" in err, err
    else:  # 8 connections a process
        assert "of 8 connections not ready within 10 s" in err, err
    assert not frontend.sent_at  # no request was sent


def test_processes_split_the_clients_and_every_request_runs_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    summary, frontend, _ = asyncio.run(
        _bench(0, "--processes", "3", "--concurrency", "5", "--num-requests", "11")
    )
    assert (summary["num_ok"], summary["num_errors"]) == (11, 0)
    assert sorted(frontend.request_ids) == sorted(f"bench-{i}" for i in range(11))
    config = summary["config"]
    assert (config["processes"], config["connections"]) == (3, 2)  # 2, 2 and 1 clients
    assert len(summary["client_cpu_percent"]) == 3
    assert all(0 < p < 400 for p in summary["client_cpu_percent"])
    # 11 requests of 3 tokens each, over the run's wall time (first start to last end)
    assert summary["output_tokens_per_s"] == pytest.approx(33 / summary["wall_s"])
    err = capsys.readouterr().err
    assert "mili bench: 11/11 done, 0 errors," in err, err
    assert report(summary).count("client     3 processes, ") == 1

    # More processes than clients: one a client.
    summary, frontend, _ = asyncio.run(_bench(0, "--processes", "4"))
    assert (summary["config"]["processes"], summary["num_ok"]) == (2, 2)
    assert sorted(frontend.request_ids) == ["bench-0", "bench-1"]


def test_the_progress_line_and_the_report_say_a_count_of_one_in_the_singular(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Found by an operator's pass: "1 errors" in the progress line, "of 1 requests refused"
    in the report."""
    from mili.client.bench_report import Progress, RequestResult

    progress = Progress(1)
    progress.record(RequestResult(error="UNAVAILABLE: down"))
    assert "mili bench: 1/1 done, 1 error, " in capsys.readouterr().err
    summary, _, _ = asyncio.run(_bench(1, "--num-requests", "1"))
    assert "retries    1 (of 1 request refused RESOURCE_EXHAUSTED with RetryInfo, " in report(
        summary
    )


def test_the_client_line_says_when_a_process_was_near_a_whole_core() -> None:
    from mili.client.bench_report import _client_line

    assert _client_line([41.6]) == "client     1 process, 42% of a core"
    assert _client_line([30.2, 44.9]) == "client     2 processes, 30-45% of a core each"
    busy = _client_line([97.0])
    assert busy.startswith("client     1 process, 97% of a core (near a whole core: ")
    assert busy.endswith("--processes)")


def test_processes_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    from mili.client.bench import run

    assert run(_args("127.0.0.1:1", "--processes", "0")) == 2
    assert "--processes must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("processes", [1, 2])
def test_an_open_loop_sends_each_request_at_its_arrival(processes: int) -> None:
    """--request-rate: 8 requests over ~0.35 s of Poisson arrivals (seed 0), 8 clients free
    for them: each is sent at its arrival, not all at once as 8 closed-loop clients send (in
    2 client processes, each sends its half at the same arrivals)."""
    from mili.client.bench_clients import arrivals

    more = ("--num-requests", "8", "--concurrency", "8", "--processes", str(processes))
    summary, frontend, _ = asyncio.run(_bench(0, *more, "--request-rate", "20"))
    assert (summary["num_ok"], summary["num_sent_late"]) == (8, 0)
    assert sorted(frontend.request_ids) == sorted(f"bench-{i}" for i in range(8))
    assert summary["config"]["request_rate"] == 20
    spread = arrivals(8, 20, 0)[-1]
    received = sorted(frontend.sent_at)
    assert received[-1] - received[0] >= spread / 2, (received, spread)
    if processes == 1:
        order = [int(rid.removeprefix("bench-")) for rid in frontend.request_ids]
        assert order == sorted(order)  # sent in the order they arrived
    (line,) = [x for x in report(summary).splitlines() if x.startswith("arrivals ")]
    assert line == "arrivals   20/s (Poisson, open loop), 0 sent late"


def test_an_open_loop_counts_the_wait_for_a_busy_client() -> None:
    """One client, requests of ~0.2 s arriving at 20 a second: all but the first are sent
    late, and their TTFT counts the wait from their arrival (a closed loop would hide it)."""
    more = ("--num-requests", "4", "--concurrency", "1", "--request-rate", "20")
    summary, _, _ = asyncio.run(_bench(0, *more, "--output-tokens", "203", stall_s=0.01))
    assert summary["num_ok"] == 4 and summary["num_sent_late"] >= 2
    late = summary["late"]
    assert late["max_ms"] > 100  # the last waited for three requests of >= 0.2 s
    assert summary["ttft"]["max_ms"] >= late["max_ms"]
    (line,) = [x for x in report(summary).splitlines() if x.startswith("arrivals ")]
    assert f"{summary['num_sent_late']} sent late (every client busy; p50 " in line


def test_the_request_rate_must_be_positive_and_finite(capsys: pytest.CaptureFixture[str]) -> None:
    from mili.client.bench import run

    for rate in ("0", "-1", "inf", "nan"):
        assert run(_args("127.0.0.1:1", "--request-rate", rate)) == 2
        assert "--request-rate must be > 0 and finite" in capsys.readouterr().err


def test_client_processes_do_not_import_the_callers_main_module_again() -> None:
    """What spawn hands a child while the pool starts its processes: nothing of __main__ (a
    benchmark script's imports would delay every client process), and afterwards __main__ is
    as it was."""
    import sys
    from multiprocessing import spawn

    from mili.client.bench_pool import _main_not_imported_again

    main = sys.modules["__main__"]
    before = (main.__dict__.get("__spec__"), main.__dict__.get("__file__"))
    assert any(key.startswith("init_main") for key in spawn.get_preparation_data("x"))
    with _main_not_imported_again():
        assert not any(key.startswith("init_main") for key in spawn.get_preparation_data("x"))
    assert (main.__dict__.get("__spec__"), main.__dict__.get("__file__")) == before
