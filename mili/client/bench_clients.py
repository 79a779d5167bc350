"""The clients of one `mili bench` process (mili.client.bench, and each of bench_pool's
processes): every connection up before the clock starts, then each client sends requests one
after another from a shared queue (open loop: each at its arrival, or as soon as a client is
free after it), each streamed to its end and timed (bench.py's docstring says what is
measured)."""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mili.client.bench_report import RequestResult

if TYPE_CHECKING:
    from mili.rpc.tls import Tls

MAX_DEFAULT_CONNECTIONS = 64  # per address, without --connections
CONNECT_TIMEOUT_S = 10.0  # every connection up before the run, or the run fails


def arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Each request's arrival, seconds after the run's start, in a Poisson process of `rate`
    requests a second: the first at 0, then exponential gaps (seeded: every client process
    computes the same)."""
    rng = random.Random(seed * 1_000_003 - 1)
    times = [0.0]
    for _ in range(num_requests - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times


def prompt_ids(index: int, num_tokens: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + index)
    return [rng.randrange(low, high) for _ in range(num_tokens)]


async def _one(
    stub: object,
    request: object,
    timeout_s: float,
    max_retries: int = 0,
    arrival: float | None = None,
) -> RequestResult:
    """One request, sent again (at most `max_retries` times) after the delay a
    RESOURCE_EXHAUSTED with RetryInfo asks for, while no token came and its deadline allows.
    `arrival` (perf_counter; open loop): when it arrived, the start of its TTFT and latency.
    None: it arrives now."""
    import grpc

    from mili.rpc.status import retry_info_of

    result = RequestResult()
    start = time.perf_counter() if arrival is None else arrival
    last: float | None = None
    while True:
        remaining_s = timeout_s - (time.perf_counter() - start)
        try:
            call = stub.Generate(request, timeout=remaining_s)  # type: ignore[attr-defined]
            async for response in call:
                now = time.perf_counter()
                n = len(response.token_ids)
                if n:
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.extend([(now - last) / n] * n)
                    last = now
                    result.num_completion_tokens += n
                if response.finish_reason:
                    result.num_prompt_tokens = response.usage.prompt_tokens
        except grpc.aio.AioRpcError as err:
            retry = retry_info_of(err) if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
            delay_s = None if retry is None else retry.retry_delay.ToNanoseconds() / 1e9
            elapsed_s = time.perf_counter() - start
            if (
                delay_s is not None
                and last is None
                and result.num_retries < max_retries
                and elapsed_s + delay_s < timeout_s
            ):
                result.num_retries += 1
                await asyncio.sleep(delay_s)
                continue
            result.error = f"{err.code().name}: {err.details()}"
        break
    result.latency_s = time.perf_counter() - start
    return result


class NotConnected(Exception):
    """Connections to a frontend that answered Info did not come up in CONNECT_TIMEOUT_S."""


async def _connect(address: str, pool: list[Any]) -> None:
    import grpc

    ready = asyncio.gather(*(c.channel_ready() for c in pool))
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            await ready
    except TimeoutError:
        waiting = sum(c.get_state() != grpc.ChannelConnectivity.READY for c in pool)
        raise NotConnected(
            f"{address}: {waiting} of {len(pool)} connections not ready within "
            f"{CONNECT_TIMEOUT_S:.0f} s (a frontend behind it hung or overloaded?)"
        ) from None


@dataclass
class ClientRun:
    """What one client process measured: its requests' results over [started, ended]
    (time.monotonic(), comparable across this machine's processes) and the CPU seconds (user +
    system, all its threads) it spent meanwhile."""

    results: list[RequestResult]
    started: float
    ended: float
    cpu_s: float
    num_connections: int  # per address


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def drive(
    args: argparse.Namespace,
    tls: Tls | None,
    addresses: list[str],
    *,
    part: int = 0,
    num_parts: int = 1,
    on_result: Callable[[RequestResult], None] | None = None,
    ready: Callable[[], Awaitable[None]] | None = None,
) -> ClientRun:
    """Part `part` of `num_parts` of the run: requests i with i % num_parts == part, over its
    share of --concurrency clients, on connections of its own to `addresses` (frontends that
    answered Info). Every connection is up before the clock starts, then `ready` is awaited
    (the other client processes' connections). NotConnected when some do not come up."""
    from mili.pb.common.v1 import sampling_pb2
    from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
    from mili.rpc.client import channel as open_channel

    low, high = (int(x) for x in args.token_id_range.split(":"))
    concurrency = args.concurrency // num_parts + (part < args.concurrency % num_parts)
    num_connections = args.connections or min(
        math.ceil(concurrency / len(addresses)), MAX_DEFAULT_CONNECTIONS
    )
    channels = {
        a: [open_channel(a, tls=tls, own_connection=True) for _ in range(num_connections)]
        for a in addresses
    }
    every_channel = [c for pool in channels.values() for c in pool]
    try:
        # Connected before the clock starts: no client's first TTFT pays a handshake.
        await asyncio.gather(*(_connect(a, channels[a]) for a in addresses))
        if ready is not None:
            await ready()
        # client i: connection i // len(addresses) of address i % len(addresses)
        stubs = [
            generation_pb2_grpc.GenerationServiceStub(channels[a][j])
            for j in range(num_connections)
            for a in addresses
        ]
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(part, args.num_requests, num_parts):
            queue.put_nowait(i)
        results: list[RequestResult] = []
        # open loop: every request's arrival after `opened` (the same in every process)
        schedule = None
        if args.request_rate is not None:
            schedule = arrivals(args.num_requests, args.request_rate, args.seed)

        async def worker(stub: Any) -> None:
            while not queue.empty():
                i = queue.get_nowait()
                arrival, late_s = None, 0.0
                if schedule is not None:
                    arrival = opened + schedule[i]
                    # taken after its arrival: no client was free for it
                    late_s = max(0.0, time.perf_counter() - arrival)
                    await asyncio.sleep(arrival - time.perf_counter())
                request = generation_pb2.GenerateRequest(
                    request_id=f"bench-{i}",
                    token_ids=prompt_ids(i, args.prompt_tokens, low, high, args.seed),
                    sampling=sampling_pb2.SamplingParams(
                        max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True
                    ),
                )
                result = await _one(stub, request, args.timeout, args.max_retries, arrival)
                result.late_s = late_s
                results.append(result)
                if on_result is not None:
                    on_result(result)

        started, cpu_started, opened = time.monotonic(), _cpu_s(), time.perf_counter()
        await asyncio.gather(*(worker(stubs[i % len(stubs)]) for i in range(concurrency)))
        ended, cpu_ended = time.monotonic(), _cpu_s()
    finally:
        for channel in every_channel:
            await channel.close()
    return ClientRun(results, started, ended, cpu_ended - cpu_started, num_connections)
