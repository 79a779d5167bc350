"""`mili bench`: load a running deployment with concurrent streaming requests and measure it.

    mili bench --address 127.0.0.1:50051 --concurrency 8 --num-requests 64 \\
               --prompt-tokens 512 --output-tokens 128 --json out.json

N workers share M requests; each request is a token_ids prompt of P random ids (seeded per
request, so runs repeat and no two prompts share a prefix), ignore_eos, max_tokens O,
temperature 0. Measured at the client, so it works against any deployment:

    TTFT           send (open loop: arrival) -> first message carrying token ids
    ITL            gap between messages carrying tokens, per token (a message with k tokens
                   counts k gaps of gap/k)
    output tok/s   completion tokens of all requests / wall time of the whole run

Each is reported as p50, p90, p99 and max: a few long gaps among thousands (a request's KV
computed again between decode steps after a preemption) stay under p99 and show in the max.

With --request-rate R the run is open loop, as a service's callers are: request i arrives at
its time in a Poisson process of R requests per second (seeded by --seed, the same every run)
and is sent then by a free client; --concurrency caps the requests in flight. TTFT and latency
count from the arrival, so a request that waited for a free client counts that wait, instead of
the load easing off when the server is slow (what a closed loop does); the report says how many
were sent late and by how much. Set --concurrency above R x the latency to send every request on
time.

KV transfer GB/s is not visible to a client (the KV moves between prefill and decode); the
frontend logs it per request (prefill's kv_bytes / transfer_ms).

Against a TLS port: --tls-ca verifies the frontend (else the system roots), --tls-cert and
--tls-key present a client certificate where the port requires one (mTLS).

While it runs, a progress line goes to stderr at every 10% of the requests and at least every
5 s: requests done of all, errors, output tokens/s so far. Failed requests are grouped by
cause: status and message with what is particular to one request masked (ids, token ids,
counts; an instance's address kept), a repeated part (a field violation per bad token id) once.
The JSON has every group, its count and one example message; the report the 10 largest, each
example cut at 300 characters, and one line for the rest.

A request refused with RESOURCE_EXHAUSTED carrying a RetryInfo (the frontend is at its
concurrency limit) is sent again after the hinted delay, up to --max-retries times, as a
well-behaved client would; its TTFT and latency count from its first send, and the retries are
counted in the report. Of several --address values, one whose Info fails with UNAVAILABLE at the
start (nothing listening, handshake refused) is skipped, with a line saying so, and the clients
share the others; with none left the run stops there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mili.client import DEFAULT_ADDRESS, timeout_problem
from mili.client.bench_clients import NotConnected, drive
from mili.client.bench_report import (
    KV_NOTE,
    LATE_S,
    Progress,
    group_errors,
    report,
    summarize,
)

if TYPE_CHECKING:
    from mili.rpc.tls import Tls


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=DEFAULT_ADDRESS,
        help="frontend address; several, comma-separated: client i uses address i mod their "
        "number (default: %(default)s)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=1, metavar="N", help="clients (default: %(default)s)"
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=None,
        metavar="C",
        help="gRPC connections per address: with A addresses client i uses connection "
        "(i // A) mod C of address i mod A; several frontend processes behind one address "
        "(`mili serve --frontends N`) share clients by connection (default: one per client, "
        "at most 64 an address)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="P",
        help="client processes: the clients (and the requests) split over P processes, each "
        "with its own connections, for loads one Python process cannot read; the report "
        "gives each one's CPU (default: %(default)s)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=None,
        metavar="R",
        help="open loop: requests arrive as a Poisson process of R a second, each sent at its "
        "arrival by a free client (--concurrency caps those in flight), timed from its arrival "
        "(default: closed loop, each client sending its next request when the last ends)",
    )
    parser.add_argument(
        "--num-requests", type=int, default=16, metavar="M", help="(default: %(default)s)"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=128, metavar="P", help="(default: %(default)s)"
    )
    parser.add_argument(
        "--output-tokens", type=int, default=64, metavar="O", help="(default: %(default)s)"
    )
    parser.add_argument(
        "--token-id-range",
        default="0:256",
        metavar="LO:HI",
        help="prompt ids are drawn from [LO, HI); must be inside the model's vocabulary "
        "(default: %(default)s, the byte tokens of any byte-level BPE)",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="deadline per request, seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--max-retries",
        type=int,
        default=5,
        metavar="N",
        help="sends of a request again after a RESOURCE_EXHAUSTED with RetryInfo, each after "
        "its hinted delay (default: %(default)s)",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write results")
    from mili.flags import add_tls_arguments

    add_tls_arguments(parser, is_server=False)


async def _live(
    stubs: dict[str, Any], info_request: object
) -> tuple[dict[str, Any], Any, list[dict[str, str]]]:
    """The stubs whose Info answers, the first answer, and the addresses skipped for
    UNAVAILABLE with their error. Re-raises any other failure, or UNAVAILABLE of every one."""
    import grpc

    async def ask(stub: Any) -> Any:
        try:
            return await stub.Info(info_request, timeout=10)
        except grpc.aio.AioRpcError as err:
            return err

    answers = await asyncio.gather(*(ask(stub) for stub in stubs.values()))
    live, skipped, info = {}, [], None
    for (address, stub), answer in zip(stubs.items(), answers, strict=True):
        if not isinstance(answer, grpc.aio.AioRpcError):
            live[address] = stub
            if info is None:
                info = answer
        elif answer.code() != grpc.StatusCode.UNAVAILABLE or len(stubs) == 1:
            raise answer
        else:
            skipped.append({"address": address, "error": f"UNAVAILABLE: {answer.details()}"})
            print(
                f"mili bench: skipping {address}: UNAVAILABLE: {answer.details()}",
                file=sys.stderr,
                flush=True,
            )
    if info is None:
        raise next(a for a in answers if isinstance(a, grpc.aio.AioRpcError))
    return live, info, skipped


async def bench(args: argparse.Namespace, tls: Tls | None = None) -> dict[str, Any]:
    """`tls`: TLS to every address (None: plaintext). With --processes P > 1 the clients run
    in P processes (mili.client.bench_pool), this one only gathering their results."""
    from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
    from mili.rpc.client import channel as open_channel

    addresses = list(dict.fromkeys(a.strip() for a in args.address.split(",") if a.strip()))
    probes = {a: open_channel(a, tls=tls, own_connection=True) for a in addresses}
    try:
        live, info, skipped = await _live(
            {a: generation_pb2_grpc.GenerationServiceStub(c) for a, c in probes.items()},
            generation_pb2.InfoRequest(),
        )
    finally:
        for probe in probes.values():
            await probe.close()
    num_processes = min(args.processes, args.concurrency)
    progress = Progress(args.num_requests)
    if num_processes == 1:

        async def ticker() -> None:
            while True:
                await asyncio.sleep(1.0)
                progress.tick()

        async def start() -> None:
            progress.start()

        ticking = asyncio.create_task(ticker())
        try:
            # The clients spread over the addresses that answered, not over every one given.
            runs = [await drive(args, tls, list(live), on_result=progress.record, ready=start)]
        finally:
            ticking.cancel()
    else:
        from mili.client import bench_pool

        # Blocking is fine: this loop has nothing else to do, and Ctrl-C then reaches the
        # pool's clean-up (its processes terminated) rather than a thread of its own.
        runs = bench_pool.run(args, tls, list(live), num_processes, progress)
    wall_s = max(r.ended for r in runs) - min(r.started for r in runs)
    results = [x for r in runs for x in r.results]
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    num_tokens = sum(r.num_completion_tokens for r in ok)
    return {
        "config": {
            "address": args.address,
            "model": info.model,
            "prefill_instances": list(info.prefill_addresses),
            "decode_instances": list(info.decode_addresses),
            "concurrency": args.concurrency,
            "connections": runs[0].num_connections,  # per address (and client process)
            "processes": num_processes,  # client processes
            "num_requests": args.num_requests,
            "request_rate": args.request_rate,  # requests/s, open loop; None: closed loop
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
        },
        "num_ok": len(ok),
        "num_errors": len(errors),
        # [{"cause": masked, "count": ..., "error": an example}], most frequent first
        "errors": group_errors(errors),
        "num_retries": sum(r.num_retries for r in results),  # sends again after RetryInfo
        "num_retried_requests": sum(1 for r in results if r.num_retries),
        "skipped_addresses": skipped,  # [{"address": ..., "error": ...}]: Info UNAVAILABLE
        "wall_s": wall_s,
        "output_tokens_per_s": num_tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl": summarize([x for r in ok for x in r.itl_s]),
        "latency": summarize([r.latency_s for r in ok]),
        # open loop: requests sent after their arrival (every client busy), and by how much
        "num_sent_late": sum(r.late_s > LATE_S for r in results),
        "late": summarize([r.late_s for r in results if r.late_s > LATE_S]),
        # % of one core each client process spent over its run (its busiest: near 100, the
        # client may be what limits the run; --processes)
        "client_cpu_percent": [
            round(100 * r.cpu_s / (r.ended - r.started), 1) if r.ended > r.started else 0.0
            for r in runs
        ],
        "kv_transfer_gbps": None,
        "kv_transfer_note": KV_NOTE,
    }


def run(args: argparse.Namespace) -> int:
    for name in ("concurrency", "num_requests", "prompt_tokens", "output_tokens"):
        if getattr(args, name) < 1:
            print(f"mili bench: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.output_tokens >= 2**31:  # max_tokens is an int32
        print("mili bench: error: --output-tokens must be below 2^31", file=sys.stderr)
        return 2
    problem = timeout_problem(args.timeout)
    if problem is not None:
        print(f"mili bench: error: {problem}", file=sys.stderr)
        return 2
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
        # checked now: found after the run, its results were lost
        print(
            f"mili bench: error: --json {args.json}: not a file in an existing directory",
            file=sys.stderr,
        )
        return 2
    if args.connections is not None and args.connections < 1:
        print("mili bench: error: --connections must be >= 1", file=sys.stderr)
        return 2
    if args.max_retries < 0:
        print("mili bench: error: --max-retries must be >= 0", file=sys.stderr)
        return 2
    if args.processes < 1:
        print("mili bench: error: --processes must be >= 1", file=sys.stderr)
        return 2
    if args.request_rate is not None and not 0 < args.request_rate < math.inf:
        print("mili bench: error: --request-rate must be > 0 and finite", file=sys.stderr)
        return 2
    try:
        low, high = (int(x) for x in args.token_id_range.split(":"))
        if not 0 <= low < high:
            raise ValueError
    except ValueError:
        message = "--token-id-range must be LO:HI with 0 <= LO < HI"
        print(f"mili bench: error: {message}", file=sys.stderr)
        return 2
    import grpc

    from mili.flags import client_tls
    from mili.rpc.client import connection_hint

    try:
        tls = client_tls(args)
    except ValueError as e:
        print(f"mili bench: error: {e}", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(bench(args, tls))
    except grpc.aio.AioRpcError as err:
        hint = connection_hint(err, is_tls=tls is not None)
        print(f"mili bench: {err.code().name}: {err.details()}{hint}", file=sys.stderr)
        return 1
    except NotConnected as err:
        print(f"mili bench: {err}", file=sys.stderr)
        return 1
    print(report(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["num_errors"] == 0 else 1
