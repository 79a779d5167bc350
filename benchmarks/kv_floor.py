"""What this host allows a prefill -> decode KV hand-off at best, with nothing of MILI in the
way: the ceilings to read benchmarks/kv_handoff.py's GB/s (and issue 15's targets) against.

Sizes are one prompt's KV on a Qwen3 preset (default qwen3-0.6b, 512 tokens, bf16: 28 layers of
K and V, 1 MiB each, 58.7 MB), moved layer by layer as a transfer moves it. Medians of
--repeats runs after a warm-up, all in one run:

  in place   the memory work an in-place (shm) transfer cannot skip: each layer's K and V
             checksummed (XXH3-64, else CRC-32: what MILI picks here) as the sender does before
             its copy, copied into a pool, and the copy checksummed again (decode's check); the
             layers spread over --threads threads (default: every core), one call per buffer
  memcpy     the copies alone, same threads: the memory bus's share
  grpc       a bare grpc.aio stream-unary call from this process to a server process on
             loopback: one pre-built message of a layer's K and V per write, the server counts
             bytes (no parsing, checksum or scatter), MILI's message limit on both sides
  grpc+work  the same call with the work a grpc transfer cannot skip, done inline (no thread
             hand-offs): the client checksums each layer's K and V and joins them into the
             message it writes, the server checksums the message and copies it into a pool

Both sides of a real transfer share this host's cores, and a 2-core VM has no third: a line's
GB/s is a ceiling for KV path GB/s, not a prediction of it.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kv_floor.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/kv_floor.py --model qwen3-8b --prompt-len 2048
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from mili.engine.model.config import PRESETS
from mili.kv_handoff import checksums
from mili.rpc.client import insecure_channel

_MAX_MESSAGE_BYTES = 256 << 20  # kv_handoff.py's limit for its channels and servers
# The checksum a pair of MILI processes picks on this host (XXH3-64 with the xxhash package).
CHECKSUM = checksums.available()[0]


def _digest(buf: memoryview | bytes) -> int:
    return checksums.digest(CHECKSUM, (buf,))  # one buffer: the one-shot function


# Targets of issue 15 on a CPU host, in GB/s.
TARGETS = {"in place": 5.0, "grpc+work": 1.5}


def layer_bytes(model: str, prompt_len: int, itemsize: int) -> int:
    """One of K or V of one layer of a prompt: [prompt_len, num_kv_heads, head_dim]."""
    config = PRESETS[model]
    return prompt_len * config.num_key_value_heads * config.head_dim * itemsize


def _time(run: Callable[[], None], repeats: int) -> float:
    """Median seconds of `run` over `repeats` calls after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_floors(num_layers: int, num_bytes: int, threads: int, repeats: int) -> dict[str, float]:
    """Seconds per transfer of the in-place work and of its copies alone."""
    rng = np.random.default_rng(0)
    # [layer, K/V, bytes]: sources as the worker's gathers, a pool as decode's (both in RAM)
    sources = rng.integers(0, 256, (num_layers, 2, num_bytes), dtype=np.uint8)
    pool = np.zeros_like(sources)

    def in_place(layer: int) -> None:
        for i in range(2):
            _digest(sources[layer, i].data)
            np.copyto(pool[layer, i], sources[layer, i])
        for i in range(2):
            _digest(pool[layer, i].data)

    def copy(layer: int) -> None:
        np.copyto(pool[layer], sources[layer])

    with ThreadPoolExecutor(threads) as pool_threads:

        def over_layers(work: Callable[[int], None]) -> Callable[[], None]:
            def run() -> None:
                for _ in pool_threads.map(work, range(num_layers)):
                    pass

            return run

        return {
            "in place": _time(over_layers(in_place), repeats),
            "memcpy": _time(over_layers(copy), repeats),
        }


# ---- grpc: a bare server in its own process ------------------------------------------------


def _warm_allocator() -> None:
    """Allocate and free a 16 MiB buffer, as a serving process does while it loads a model:
    glibc then keeps megabyte buffers (messages) on its heap instead of mapping, faulting in
    and unmapping each one afresh, which costs this VM more than the copies themselves (here the
    grpc floors took 1.6-3x as long without it, docs/benchmarks.md)."""
    bytearray(16 << 20)


async def _serve(num_layers: int, num_bytes: int) -> None:
    _warm_allocator()

    pool = np.zeros((num_layers, 2 * num_bytes), dtype=np.uint8)  # decode's, for grpc+work

    async def transfer(messages: Any, context: grpc.aio.ServicerContext) -> bytes:
        received = 0
        async for message in messages:
            received += len(message)
        return str(received).encode()

    async def land(messages: Any, context: grpc.aio.ServicerContext) -> bytes:
        layer = 0
        async for message in messages:
            _digest(message)
            np.copyto(pool[layer], np.frombuffer(message, dtype=np.uint8))
            layer += 1
        return str(layer).encode()

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)])
    handlers = {  # bytes in, bytes out
        "Transfer": grpc.stream_unary_rpc_method_handler(transfer),
        "Land": grpc.stream_unary_rpc_method_handler(land),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("floor.Floor", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def _time_async(run: Callable[[], Awaitable[None]], repeats: int) -> float:
    """`_time` for a coroutine function."""
    await run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def grpc_floors(num_layers: int, num_bytes: int, repeats: int) -> dict[str, float]:
    """Seconds per transfer over a bare grpc.aio call, without and with the work, and the CPU
    ms per transfer of each side ("NAME cpu": this process, "NAME server cpu")."""
    from benchmarks.kv_handoff import process_cpu_s  # torch and the engine: the client only

    command = [sys.executable, __file__, "--serve", str(num_layers), str(num_bytes)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        messages = [os.urandom(2 * num_bytes) for _ in range(num_layers)]
        # [layer, K/V, bytes]: the worker's gathers, which grpc+work checksums and joins
        views = [memoryview(message) for message in messages]
        layers = [(view[:num_bytes], view[num_bytes:]) for view in views]
        async with insecure_channel(
            f"127.0.0.1:{port}", max_message_bytes=_MAX_MESSAGE_BYTES
        ) as channel:
            call_transfer = channel.stream_unary("/floor.Floor/Transfer")
            call_land = channel.stream_unary("/floor.Floor/Land")

            async def transfer() -> None:
                call = call_transfer()
                for message in messages:
                    await call.write(message)
                await call.done_writing()
                await call

            async def transfer_with_work() -> None:
                call = call_land()
                for k, v in layers:
                    _digest(k)
                    _digest(v)
                    await call.write(b"".join((k, v)))
                await call.done_writing()
                await call

            floors: dict[str, float] = {}
            for name, run in (("grpc", transfer), ("grpc+work", transfer_with_work)):
                client_cpu, server_cpu = time.process_time(), process_cpu_s(server.pid)
                floors[name] = await _time_async(run, repeats)
                num_runs = repeats + 1  # the warm-up's CPU is in the count
                server_cpu = process_cpu_s(server.pid) - server_cpu
                floors[f"{name} cpu"] = (time.process_time() - client_cpu) / num_runs * 1e3
                floors[f"{name} server cpu"] = server_cpu / num_runs * 1e3
            return floors
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(PRESETS))
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--itemsize", type=int, default=2, help="bytes per element (bf16: 2)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(*args.serve))
        return
    _warm_allocator()
    num_layers = PRESETS[args.model].num_hidden_layers
    num_bytes = layer_bytes(args.model, args.prompt_len, args.itemsize)
    total = 2 * num_layers * num_bytes
    floors = memory_floors(num_layers, num_bytes, args.threads, args.repeats)
    floors |= asyncio.run(grpc_floors(num_layers, num_bytes, args.repeats))
    rows = [
        {
            "floor": name,
            "ms": floors[name] * 1e3,
            "gb_per_s": total / floors[name] / 1e9,
            "target_gb_per_s": TARGETS.get(name),
            "client_cpu_ms": floors.get(f"{name} cpu"),
            "server_cpu_ms": floors.get(f"{name} server cpu"),
        }
        for name in ("in place", "memcpy", "grpc", "grpc+work")
    ]
    if args.json:
        print(json.dumps({"kv_mb": total / 1e6, "checksum": CHECKSUM, "rows": rows}))
        return
    print(
        f"KV hand-off floors: {args.model}, {args.prompt_len} tokens x {args.itemsize} B, "
        f"{total / 1e6:.1f} MB in {num_layers} layers; {CHECKSUM}; {args.threads} threads; "
        f"medians of {args.repeats} runs\n"
    )
    print(f"{'floor':10} {'ms':>7} {'GB/s':>6} {'CPU c/s':>9}  target")
    for row in rows:
        target = row["target_gb_per_s"]
        cpu = "-"
        if row["client_cpu_ms"] is not None:
            cpu = f"{row['client_cpu_ms']:.0f}/{row['server_cpu_ms']:.0f}"
        print(
            f"{row['floor']:10} {row['ms']:7.1f} {row['gb_per_s']:6.2f} {cpu:>9}  "
            + ("" if target is None else f">= {target} GB/s")
        )
    print("\nCPU c/s: CPU ms per transfer of the client (this process) and the server process")


if __name__ == "__main__":
    main()
