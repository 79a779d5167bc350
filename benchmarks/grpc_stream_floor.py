"""The floor under the frontend's CPU per streamed token: what a bare grpc.aio server spends per
server-streamed GenerateResponse, with nothing of MILI in the handler.

A server process streams `--tokens` one-token GenerateResponses to each of `--concurrency`
clients on one channel (as `mili bench` opens them), all woken together every `--step-ms` as
a decode step wakes the frontend's requests; the client (this process) reads them. Prints the
server's CPU milliseconds (user + system, /proc) per message. The frontend sends one such
message per token while a client keeps up (`serve-frontend --stream-interval 1`), so its CPU
per token cannot go below this.

    .venv/bin/python benchmarks/grpc_stream_floor.py --concurrency 64 --step-ms 13
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import AsyncIterator

import grpc

from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc


class _Steps(generation_pb2_grpc.GenerationServiceServicer):
    """Every open stream sends its next message when the shared step future resolves."""

    def __init__(self, num_tokens: int, step_s: float) -> None:
        self._num_tokens = num_tokens
        self._step_s = step_s
        self._step: asyncio.Future[None] | None = None

    async def tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._step = loop.create_future()
            await asyncio.sleep(self._step_s)
            self._step.set_result(None)

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: object
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        for i in range(self._num_tokens):
            assert self._step is not None
            await asyncio.shield(self._step)
            yield generation_pb2.GenerateResponse(request_id="r", token_ids=[i], text="ab")


def _serve(args: argparse.Namespace, port_pipe: int) -> None:
    async def main() -> None:
        steps = _Steps(args.tokens, args.step_ms / 1000)
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(steps, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ticker = asyncio.create_task(steps.tick())
        os.write(port_pipe, f"{port}\n".encode())
        await server.wait_for_termination()
        ticker.cancel()

    asyncio.run(main())


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _read_all(port: int, args: argparse.Namespace, server_pid: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def one() -> int:
            return len([r async for r in stub.Generate(generation_pb2.GenerateRequest())])

        await asyncio.gather(*(one() for _ in range(8)))  # warm-up
        cpu_before, started = _cpu_s(server_pid), time.monotonic()
        counts = await asyncio.gather(*(one() for _ in range(args.concurrency)))
        cpu_after, wall_s = _cpu_s(server_pid), time.monotonic() - started
    num = sum(counts)
    print(
        f"concurrency {args.concurrency}, step {args.step_ms} ms: {num} messages, "
        f"{num / wall_s:.0f} messages/s, server CPU {1e3 * (cpu_after - cpu_before) / num:.4f} "
        f"ms per message; load average {os.getloadavg()[0]:.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128, help="messages per stream")
    parser.add_argument("--step-ms", type=float, default=13.0)
    args = parser.parse_args()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server: its own process, so its CPU is its own
        os.close(read_end)
        _serve(args, write_end)
        os._exit(0)
    os.close(write_end)
    port = int(os.read(read_end, 64).decode())
    try:
        asyncio.run(_read_all(port, args, pid))
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
