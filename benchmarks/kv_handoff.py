"""Prefill -> decode KV hand-off on CPU: does streaming the KV hide behind the prefill's compute?

Random-weight Qwen3-0.6B (--preset "qwen3-0.6b", bf16, written once into --cache-dir and reused,
shared with generate_cpu.py; `tiny`, benchmarks/presets.py, checks this script in seconds), one
prompt of --prompt-len tokens (512 tokens x 112 KiB = 58.7 MB of KV in 28 layer chunks of
2.1 MB). Medians over --repeats runs after one warm-up:

  compute alone   the prompt's prefill as the service computes it for the receiver: replayed
                  from the service's CUDA graphs (captured on CUDA, as `mili serve-prefill`
                  does) where the KV goes to a device sink (cuda-ipc), else model.prefill in
                  this process, eagerly; no layer callback, no transfer
  start -> ack    a Prefill call to the prefill service (in this process, real gRPC on loopback)
                  until the receiver acknowledged the commit; compute alone is measured right
                  before each call so that load from other processes hits both alike
  KV path alone   the same KV, already computed, through the sender (KvSender fed every layer
                  at once): encode + CRC-32 + gRPC + the receiver's checks and scatter -> GB/s;
                  in place, a line under the row times the transport's own encode_all and
                  land_all apart, in this process: the rest of the KV path is its hops

Receivers, each a separate process on loopback:
  checker   validates every chunk (codec.decode_chunk) and scatters it into its own KV
            cache on a worker thread, pipelined with reading the stream
  discard   counts bytes only: the prefill side's own ceiling
  (both read chunks in place, with codec.parse_transfer_request, as decode does)
  decode    the real `mili serve-decode` (a Generate call reserves the blocks first), started
            with --kv-transport grpc: the bytes in the chunks; skipped with --no-decode
  decode-shm  the real decode service pairing in place: over shm on the CPU (its KV pool in
            POSIX shared memory), over cuda-ipc with --device cuda (its pool exported with CUDA
            IPC); prefill writes the blocks itself, the chunks carry block ids and a checksum

Targets: KV path >= 0.5 GB/s (grpc; issue 15: >= 1.5), >= 5 GB/s (shm); start -> ack <= 1.3 x
compute alone (shm: <= 1.05 x).

    .venv/bin/python benchmarks/kv_handoff.py
    .venv/bin/python benchmarks/kv_handoff.py --prompt-len 1024 --repeats 5 --json
    .venv/bin/python benchmarks/kv_handoff.py --receivers decode --path-only --repeats 15
    .venv/bin/python benchmarks/kv_handoff.py --receivers decode,decode-shm --repeats 5
    python3 benchmarks/kv_handoff.py --device cuda --receivers decode,decode-shm --repeats 5
                                                  # a GPU host: grpc with CUDA and cuda-ipc
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.presets, as a script

from benchmarks.presets import CHOICES, DEFAULT_CACHE, preset_checkpoint, preset_config
from kernels.choice import select_kernels
from kernels.self_check import CheckShape
from mili.discovery import ANY
from mili.engine.engine_config import EngineConfig
from mili.engine.model.config import Qwen3Config
from mili.engine.model.fingerprint import model_fingerprint
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.loader import load_config, load_model
from mili.engine.model.qwen3 import PrefillBatch, Qwen3ForCausalLM
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.pinned import StagingRing
from mili.engine.step.prefill_graphs import PrefillGraphs
from mili.engine.step.runner import ModelRunner
from mili.engine.step.startup import graphs_allowed
from mili.kv_handoff.codec import ChunkView, decode_chunk, parse_transfer_request, torch_dtype
from mili.kv_handoff.kv_part import KvPart
from mili.kv_handoff.kv_transport import CUDA_IPC
from mili.pb.common.v1 import sampling_pb2
from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.pb.kv.v1 import kv_pb2, kv_pb2_grpc
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from mili.rpc.client import insecure_channel
from mili.rpc.kv_layout import check_compatible
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig
from services.prefill.config import PrefillConfig
from services.prefill.instance import PrefillInstance
from services.prefill.pairing import Pairing
from services.prefill.sender import KvSender
from services.prefill.server import PrefillServicer, add_to_server
from services.prefill.task import FirstToken, PrefillTask
from services.prefill.worker import hand_over

RECEIVERS = ("discard", "checker", "decode", "decode-shm")
# The real decode service, per KV transport: its flags (a decode forced to grpc pairs over grpc).
DECODE_TRANSPORTS = {"decode": ["--kv-transport", "grpc"], "decode-shm": []}
BLOCK_SIZE = 16
ROOT = Path(__file__).resolve().parent.parent


# ---- receiver processes (checker, discard) ---------------------------------------------------


class _Receiver(kv_pb2_grpc.KvTransferServiceServicer):
    """Any request may write blocks 0..N-1; `cache` None counts bytes and checks nothing."""

    def __init__(self, layout: kv_pb2.KvLayout, cache: KVCache | None) -> None:
        self.layout, self.cache = layout, cache
        self.lander = ThreadPoolExecutor(1)  # one thread: chunks land in order

    def _land(self, chunk: ChunkView) -> None:
        assert self.cache is not None
        k, v = decode_chunk(chunk, self.layout)
        self.cache.scatter_blocks(chunk.layer, list(chunk.block_ids), k, v)

    async def TransferKv(self, requests: Any, context: Any) -> kv_pb2.TransferKvResponse:
        loop = asyncio.get_running_loop()
        iterator = aiter(requests)
        header = (await anext(iterator)).header
        check_compatible(self.layout, header.layout, local_name="decode", remote_name="prefill")
        num_bytes = 0
        landing: list[asyncio.Future[None]] = []
        async for chunk in iterator:
            if not isinstance(chunk, ChunkView):  # the commit
                await asyncio.gather(*landing)  # raises DataLoss from any chunk
                return kv_pb2.TransferKvResponse(num_bytes=num_bytes)
            if self.cache is not None:  # checks and copy off the event loop, not awaited here
                landing.append(loop.run_in_executor(self.lander, self._land, chunk))
            num_bytes += len(chunk.data)
        await context.abort(grpc.StatusCode.DATA_LOSS, "no commit")
        raise AssertionError


async def _serve_receiver(layout_hex: str, num_blocks: int, config: Qwen3Config) -> None:
    layout = kv_pb2.KvLayout.FromString(bytes.fromhex(layout_hex))
    cache = None
    if num_blocks:
        cache = KVCache(config, num_blocks, layout.block_size, dtype=torch_dtype(layout))
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 << 20)])
    receiver = _Receiver(layout, cache)
    # As decode reads them: each chunk's bytes left in place (codec.parse_transfer_request).
    handler = grpc.stream_unary_rpc_method_handler(
        receiver.TransferKv,
        request_deserializer=parse_transfer_request,
        response_serializer=kv_pb2.TransferKvResponse.SerializeToString,
    )
    service = kv_pb2.DESCRIPTOR.services_by_name["KvTransferService"].full_name
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {"TransferKv": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def _start(command: list[str]) -> tuple[subprocess.Popen[str], str]:
    """A process that announces `... listening on HOST:PORT` on stdout."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.split()[-1]
    raise RuntimeError(f"{command[:4]} exited {proc.wait()} before listening")


# ---- where the KV goes: a fixed block range, or a reservation made with decode --------------

# reserve(request_id) -> the reservation (prompt block ids and transfer token); the context
# holds it for the transfer.
Reserve = Callable[[str], contextlib.AbstractAsyncContextManager[decode_pb2.Admitted]]


def fixed_blocks(num_blocks: int) -> Reserve:
    @contextlib.asynccontextmanager
    async def reserve(request_id: str) -> AsyncIterator[decode_pb2.Admitted]:
        yield decode_pb2.Admitted(prompt_block_ids=range(num_blocks))

    return reserve


def decode_reservation(
    channel: grpc.aio.Channel, prompt: list[int], layout: kv_pb2.KvLayout
) -> Reserve:
    stub = decode_pb2_grpc.DecodeServiceStub(channel)

    @contextlib.asynccontextmanager
    async def reserve(request_id: str) -> AsyncIterator[decode_pb2.Admitted]:
        stream = stub.Generate(
            decode_pb2.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=1),
                prefill_layout=layout,
            ),
            timeout=600,
        )
        events = aiter(stream)
        admitted = (await anext(events)).admitted
        yield admitted
        async for _ in events:  # decode's token event: the request is done, blocks freed
            pass

    return reserve


# ---- measurements ----------------------------------------------------------------------------


def compute_alone(
    model: Qwen3ForCausalLM, prompt: list[int], graphs: PrefillGraphs | None = None
) -> float:
    """Seconds of one prefill of `prompt`, no layer callback, no transfer, as the service
    computes it for the receiver at hand: replayed from its CUDA graphs (`graphs`: the
    service's own, in its pool's first blocks while it idles between calls) where its KV goes
    to a device sink (cuda-ipc), else one eager model.prefill on a cache of its own."""
    blocks = list(range(-(-len(prompt) // BLOCK_SIZE)))
    size = None if graphs is None else graphs.size_for([prompt])
    if graphs is not None and size is not None:
        _synchronize(model.device)
        start = time.perf_counter()
        graphs.run([prompt], [blocks], [0], size)
        _synchronize(model.device)
        return time.perf_counter() - start
    cache = KVCache(model.config, len(blocks), BLOCK_SIZE, dtype=model.dtype, device=model.device)
    batch = PrefillBatch.build([prompt], [blocks], BLOCK_SIZE, device=model.device)
    _synchronize(model.device)
    start = time.perf_counter()
    model.prefill(batch, cache)
    _synchronize(model.device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def compute_and_handoff(
    stub: prefill_pb2_grpc.PrefillServiceStub,
    model: Qwen3ForCausalLM,
    address: str,
    reserve: Reserve,
    prompt: list[int],
    repeats: int,
    graphs: PrefillGraphs | None = None,
) -> list[tuple[float, float, prefill_pb2.PrefillResponse]]:
    """(compute alone s, start -> ack s, reply) per run, after one warm-up run. `graphs`: the
    service's prefill graphs where it replays them for this receiver (compute_alone)."""
    results = []
    for i in range(repeats + 1):
        # In a thread, like the service's worker; the event loop idles meanwhile.
        alone = await asyncio.to_thread(compute_alone, model, prompt, graphs)
        request_id = f"full-{i}-{time.monotonic_ns()}"
        async with reserve(request_id) as admitted:
            request = prefill_pb2.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling_pb2.SamplingParams(temperature=0.0),
                destination=prefill_pb2.KvDestination(
                    address=address,
                    prompt_block_ids=admitted.prompt_block_ids,
                    transfer_token=admitted.transfer_token,
                ),
            )
            start = time.perf_counter()
            reply = await stub.Prefill(request, timeout=600)
            results.append((alone, time.perf_counter() - start, reply))
    return results[1:]


async def kv_path_alone(
    servicer: PrefillServicer,
    address: str,
    reserve: Reserve,
    prompt: list[int],
    repeats: int,
    phases: list[tuple[float, float]] | None = None,
) -> list[tuple[float, int]]:
    """(seconds, KV bytes) per run: every layer's blocks handed to a KvSender at once, over
    the transport the prefill service pairs with `address`. In place, `phases` (when given)
    gets each run's in_place_phases, timed in its reservation before its transfer."""
    pairing = await servicer.peers.pair(address)
    cache = servicer.worker.kv_cache
    # Gathered once, outside the timed runs, as the worker hands them over.
    on_device = pairing.kv.takes_device_tensors
    gathered = _gathered(cache, on_device, len(prompt))
    # Staging for device -> host copies (GPU, grpc) sized as the worker's, but its own: these
    # copies run on this thread's side stream, the worker's on the worker's, and a span comes
    # round again safely only behind the copies of one stream.
    worker_staging = servicer.worker.staging
    staging = None if worker_staging is None else StagingRing(worker_staging.capacity, cache.device)
    results = []
    with ThreadPoolExecutor(2) as encoder:
        async with insecure_channel(address, max_message_bytes=256 << 20) as channel:
            for i in range(repeats + 1):
                request_id = f"path-{i}-{time.monotonic_ns()}"
                async with reserve(request_id) as admitted:
                    task = PrefillTask(
                        request_id,
                        prompt,
                        SamplingParams(),
                        address,
                        list(admitted.prompt_block_ids),
                        transfer_token=admitted.transfer_token,
                    )
                    sender = KvSender(
                        task,
                        channel=channel,
                        encoder=encoder,
                        layout=servicer.layout,
                        num_chunks=cache.num_layers,
                        timeout_s=600,
                        pairing=pairing,
                    )

                    def push(sender: KvSender = sender) -> None:
                        # As the worker hands layers over: on a GPU, device to pinned host
                        # behind an event (grpc), or the event alone (cuda-ipc).
                        for layer, kv in gathered:
                            sender.send_blocks(layer, 0, *hand_over(kv, on_device, staging))
                        sender.finish(FirstToken(0, None, None, 0.0, 0.0))

                    if phases is not None and pairing.kv.is_in_place:
                        block_ids = list(admitted.prompt_block_ids)
                        phases.append(in_place_phases(pairing, gathered, block_ids))
                    start = time.perf_counter()
                    result = await sender.run(push, lambda: None)
                    results.append((time.perf_counter() - start, result.kv_bytes))
    return results[1:]


def in_place_phases(
    pairing: Pairing, gathered: list[tuple[int, torch.Tensor]], block_ids: list[int]
) -> tuple[float, float]:
    """An in-place transport's own work for one transfer, timed apart (seconds): the sender's
    `encode_all` of every layer (the copies into decode's blocks `block_ids` and their
    checksums, read back: an encoder thread's work), then the receiver's `land_all` of the
    chunks it announced (the blocks' checksums, read back: a landing thread's work) on this
    process's mapping of the same blocks. What the KV path takes beyond their sum is the
    hops: threads, gRPC, the commit."""
    parts = [KvPart(layer, block_ids[: kv.shape[2]], kv) for layer, kv in gathered]
    start = time.perf_counter()
    messages, _ = pairing.kv.encode_all("phases", 0, parts, pairing.checksum)
    encode = time.perf_counter() - start
    chunks = [parse_transfer_request(m) for m in messages]
    start = time.perf_counter()
    pairing.kv.land_all(chunks, pairing.checksum)
    return encode, time.perf_counter() - start


def _gathered(cache: KVCache, on_device: bool, num_tokens: int) -> list[tuple[int, torch.Tensor]]:
    """(first layer, KV) as the worker hands a prompt's blocks over: each layer alone (grpc,
    shm) or every layer at once (cuda-ipc, `on_device`), complete (synchronized)."""
    index = cache.block_index(list(range(-(-num_tokens // BLOCK_SIZE))))
    step = cache.num_layers if on_device else 1
    gathered = [
        (layer, cache.gather_layers(layer, layer + step, index))
        for layer in range(0, cache.num_layers, step)
    ]
    _synchronize(cache.device)
    return gathered


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads) so far; Linux /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def kv_path_with_cpu(
    servicer: PrefillServicer,
    address: str,
    receiver_pid: int,
    reserve: Reserve,
    prompt: list[int],
    repeats: int,
) -> tuple[list[tuple[float, int]], dict[str, float]]:
    """kv_path_alone, and the CPU both sides spent per transfer over its runs (this process:
    the sender, its event loop and encoder threads; the receiver's process: everything,
    reserving the blocks included): where a 2-core host's time goes when GB/s stall."""
    sender, receiver = time.process_time(), process_cpu_s(receiver_pid)
    runs = await kv_path_alone(servicer, address, reserve, prompt, repeats)
    num_transfers = repeats + 1  # the warm-up run included
    cpu = {
        "sender_cpu_ms": (time.process_time() - sender) / num_transfers * 1e3,
        "receiver_cpu_ms": (process_cpu_s(receiver_pid) - receiver) / num_transfers * 1e3,
    }
    return runs, cpu


def summarize(name: str, path_runs: list[Any], full_runs: list[Any] | None) -> dict[str, Any]:
    kv_bytes = path_runs[0][1]
    path_s = statistics.median(t for t, _ in path_runs)
    row: dict[str, Any] = {
        "receiver": name,
        "kv_mb": kv_bytes / 1e6,
        "kv_path_ms": path_s * 1e3,
        "kv_path_gb_s": kv_bytes / path_s / 1e9,
        "runs_kv_path_ms": [round(t * 1e3) for t, _ in path_runs],
    }
    if full_runs:
        replies = [r for _, _, r in full_runs]
        row |= {
            "compute_alone_ms": statistics.median(a for a, _, _ in full_runs) * 1e3,
            "start_to_ack_ms": statistics.median(t for _, t, _ in full_runs) * 1e3,
            "ratio": statistics.median(t / a for a, t, _ in full_runs),
            "service_compute_ms": statistics.median(r.compute_ms for r in replies),
            "tail_ms": statistics.median(
                t * 1e3 - r.compute_ms - r.queue_ms for _, t, r in full_runs
            ),
            "runs_compute_alone_ms": [round(a * 1e3) for a, _, _ in full_runs],
            "runs_start_to_ack_ms": [round(t * 1e3) for _, t, _ in full_runs],
        }
    return row


def prefill_in_process(
    path: Path, prompt_len: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
) -> tuple[Qwen3ForCausalLM, PrefillServicer, list[int], int]:
    """The prefill service's servicer on `path`'s model (in `dtype`, on `device`) in this
    process, a random prompt of `prompt_len` ids, and its number of blocks
    (benchmarks/topology.py too)."""
    kernels: dict[str, Any] = {}
    if device.startswith("cuda"):  # the kernels `mili serve` runs there, self-check included
        dtype_name = str(dtype).removeprefix("torch.")
        shape = CheckShape.of(load_config(path), BLOCK_SIZE, dtype_name)
        chosen = select_kernels("auto", device, shape)
        kernels = {"attention": chosen.attention, "fused_ops": chosen.fused_ops}
        print(f"kernels: attention {chosen.attention.name}, fused ops {chosen.fused_ops.name}")
    model = load_model(path, dtype=dtype, device=device, **kernels)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist()
    num_blocks = -(-prompt_len // BLOCK_SIZE)
    config = PrefillConfig(
        engine=EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        max_batch_tokens=max(2048, prompt_len),
        max_queued_tokens=max(8192, prompt_len),
        transfer_timeout_s=600,
        allowed_decodes=(ANY,),  # the receiver's and decode's ports are chosen later
        prefix_caching=False,  # every run computes and sends the whole (repeated) prompt
    )
    runner = ModelRunner.create(model, num_blocks, BLOCK_SIZE)
    if device.startswith("cuda") and graphs_allowed(config.engine, model):
        # As the service's runner: its steps whose KV goes to a device sink replay them.
        captured = runner.capture_prefill_graphs(config.max_batch_tokens)
        print(f"prefill graphs: {'captured' if captured else 'off (eager)'}", flush=True)
    instance = PrefillInstance.create(
        runner,
        config,
        model_name=path.name,
        fingerprint=model_fingerprint(path),
    )
    return model, PrefillServicer(instance, max_message_bytes=256 << 20), prompt, num_blocks


async def measure(
    args: argparse.Namespace, path: Path, on_row: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    """One row per receiver, each passed to `on_row` as soon as it is measured."""
    dtype = getattr(torch, args.dtype)
    model, servicer, prompt, num_blocks = prefill_in_process(
        path, args.prompt_len, dtype, args.device
    )
    layout_hex = servicer.layout.SerializeToString().hex()
    me = [sys.executable, __file__, "--receiver-threads", str(args.receiver_threads)]
    me += ["--preset", args.preset]
    procs: list[subprocess.Popen[str]] = []
    server = RpcServer(ServerConfig(max_message_bytes=256 << 20), name="prefill")
    add_to_server(server, servicer)
    port = await server.start()
    rows = []
    try:
        async with insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            for name, blocks in (("discard", 0), ("checker", num_blocks)):
                if name not in args.receivers:
                    continue
                proc, address = _start([*me, "--serve-receiver", layout_hex, str(blocks)])
                procs.append(proc)
                reserve = fixed_blocks(num_blocks)
                path_runs, cpu = await kv_path_with_cpu(
                    servicer, address, proc.pid, reserve, prompt, args.repeats
                )
                full_runs = None
                if name == "checker" and args.full:
                    full_runs = await compute_and_handoff(
                        stub, model, address, reserve, prompt, args.repeats
                    )
                rows.append(summarize(name, path_runs, full_runs) | cpu)
                on_row(rows[-1])
            for name, transport_args in DECODE_TRANSPORTS.items():
                if name not in args.receivers:
                    continue
                decode_args = ["--port", "0", "--num-blocks", str(2 * num_blocks + 8)]
                decode_args += ["--block-size", str(BLOCK_SIZE), "--log-level", "WARNING"]
                decode_args += ["--dtype", args.dtype]  # decode's CPU default is float32
                decode_args += ["--device", args.device]
                decode_args += ["--no-prefix-cache"]  # each run receives the whole prompt
                mili = [sys.executable, "-m", "mili", "serve-decode", "--model", str(path)]
                proc, address = _start([*mili, *decode_args, *transport_args])
                procs.append(proc)
                async with insecure_channel(address) as decode_channel:
                    reserve = decode_reservation(decode_channel, prompt, servicer.layout)
                    path_runs, cpu = await kv_path_with_cpu(
                        servicer, address, proc.pid, reserve, prompt, args.repeats
                    )
                    transport = servicer.peers.transports()[address]
                    phases: dict[str, float] = {}
                    if (await servicer.peers.pair(address)).kv.is_in_place:
                        # More transfers, each with its phases timed apart first (not in the
                        # CPU per transfer above).
                        timed: list[tuple[float, float]] = []
                        await kv_path_alone(servicer, address, reserve, prompt, args.repeats, timed)
                        timed = timed[1:] or timed  # the warm-up's out
                        phases = {
                            "encode_ms": statistics.median(e for e, _ in timed) * 1e3,
                            "land_ms": statistics.median(land for _, land in timed) * 1e3,
                        }
                    # The service replays its prefill graphs only for a device sink.
                    graphs = servicer.worker.runner.prefill_graphs
                    graphs = graphs if transport == CUDA_IPC else None
                    full_runs = None
                    if args.full:
                        full_runs = await compute_and_handoff(
                            stub, model, address, reserve, prompt, args.repeats, graphs
                        )
                row = summarize(name, path_runs, full_runs) | cpu | phases
                row["transport"] = transport
                rows.append(row)
                on_row(row)
    finally:
        await server.drain()
        await servicer.close()
        for proc in procs:
            proc.kill()
            proc.wait()
    return rows


def print_row(r: dict[str, Any]) -> None:
    full = (
        [
            f"{r['compute_alone_ms']:.0f}",
            f"{r['start_to_ack_ms']:.0f}",
            f"{r['ratio']:.2f}",
            f"{r['tail_ms']:.1f}",
        ]
        if "ratio" in r
        else ["-"] * 4
    )
    cpu = f"{r['sender_cpu_ms']:.0f}/{r['receiver_cpu_ms']:.0f}"
    print(
        "{:<11}{:>7.1f}{:>9.0f}{:>7.2f}{:>10}{:>12}{:>7}{:>7}{:>10}  {}".format(
            r["receiver"],
            r["kv_mb"],
            r["kv_path_ms"],
            r["kv_path_gb_s"],
            *full,
            cpu,
            r.get("transport", "grpc"),
        ),
        flush=True,
    )
    if "encode_ms" in r:
        rest = r["kv_path_ms"] - r["encode_ms"] - r["land_ms"]
        print(
            f"{'':<11}in place, timed apart: encode {r['encode_ms']:.2f} ms (copies + "
            f"checksums), land {r['land_ms']:.2f} ms (checks), the rest {rest:.2f} ms (hops)",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b", choices=CHOICES)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="model and KV dtype (default: %(default)s, the issue's 57 MB; float32 where the CPU "
        "has no fast bf16 matmul, e.g. AVX2 only: twice the bytes, about 6x less compute)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="prefill's and decode's device (default: %(default)s); with cuda, decode-shm pairs "
        "over cuda-ipc and decode copies through pinned host memory (the checker and discard "
        "receivers stay on the CPU)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads of the prefill (default: %(default)s; on a small shared "
        "CPU a second spinning OpenMP thread slows the forward and starves the transfer)",
    )
    parser.add_argument(
        "--receiver-threads", type=int, default=1, help="torch threads of the checker receiver"
    )
    parser.add_argument(
        "--receivers",
        type=lambda s: s.split(","),
        default=list(RECEIVERS),
        help=f"comma-separated subset of {','.join(RECEIVERS)} (default: all)",
    )
    parser.add_argument(
        "--no-decode", dest="decode", action="store_false", help="skip the real decode service"
    )
    parser.add_argument(
        "--path-only",
        dest="full",
        action="store_false",
        help="measure the KV path alone (no prefill compute runs: much quicker)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve-receiver", nargs=2, metavar=("LAYOUT_HEX", "NUM_BLOCKS"))
    args = parser.parse_args()
    if unknown := set(args.receivers) - set(RECEIVERS):
        parser.error(f"--receivers: unknown {sorted(unknown)}; choose from {RECEIVERS}")
    if not args.decode:
        args.receivers = [r for r in args.receivers if r not in DECODE_TRANSPORTS]
    if args.serve_receiver:
        torch.set_num_threads(args.receiver_threads)
        layout_hex, num_blocks = args.serve_receiver
        asyncio.run(_serve_receiver(layout_hex, int(num_blocks), preset_config(args.preset)))
        return
    torch.set_num_threads(args.threads)
    path = preset_checkpoint(args.preset, args.cache_dir)
    if args.json:
        print(json.dumps(asyncio.run(measure(args, path, lambda row: None)), indent=2))
        return
    print(
        f"KV hand-off: {args.preset} {args.dtype}, {args.prompt_len}-token prompt, "
        f"torch threads {args.threads}, medians of {args.repeats} runs (ms unless noted)\n"
    )
    header = ("receiver", "KV MB", "KV path", "GB/s", "compute", "start->ack", "ratio", "tail")
    print("{:<11}{:>7}{:>9}{:>7}{:>10}{:>12}{:>7}{:>7}{:>10}  transport".format(*header, "CPU s/r"))
    rows = asyncio.run(measure(args, path, print_row))
    print("\ntargets: KV path >= 0.5 GB/s; start->ack <= 1.3 x compute alone (ratio = median of")
    print("per-run ratios; tail = start->ack - queue - compute inside the service); CPU s/r =")
    print("CPU ms per KV-path transfer of the sender's and the receiver's process")
    for r in rows:
        runs = {k: v for k, v in r.items() if k.startswith("runs_")}
        print(f"{r['receiver']}: {runs}")


if __name__ == "__main__":
    main()
