"""`mili serve-decode` as an operator runs it: flags, start-up log, lease flag, drain, errors."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mili.engine.sampling_params import SamplingParams
from mili.pb.decode.v1 import decode_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.rpc.client import insecure_channel
from tests.decode.conftest import BLOCK_SIZE
from tests.decode.harness import Client, PrefillPlayer, blocks_back, random_prompt, sampling
from tests.service_process import ROOT, ServiceProcess

GREEDY = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
LEASE_MS = 1500


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path) -> Iterator[ServiceProcess]:
    process = ServiceProcess(
        "serve-decode",
        "--model",
        str(tiny_model_dir),
        "--port",
        "0",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-blocks",
        "24",
        "--max-running",
        "4",
        "--kv-lease-ms",
        str(LEASE_MS),
        "--drain-timeout",
        "20",
    )
    yield process
    if process.proc.poll() is None:
        process.terminate()


def test_logs_and_info_describe_the_instance(service: ServiceProcess, tiny_model_dir: Path) -> None:
    log = service.stderr
    for words in ("on cpu in float32", "24 KV blocks of 8 tokens", "attention torch"):
        assert words in log, log
    assert tiny_model_dir.name in log

    async def body() -> None:
        async with insecure_channel(service.address) as channel:
            info = await Client(channel).info()
            assert (info.num_total_blocks, info.num_free_blocks, info.max_running) == (24, 24, 4)
            assert info.kv_layout.block_size == BLOCK_SIZE

    asyncio.run(body())


def test_greedy_request_end_to_end(service: ServiceProcess, player: PrefillPlayer) -> None:
    prompt = random_prompt(19, player.vocab_size, seed=50)

    async def body() -> None:
        async with insecure_channel(service.address) as channel:
            client = Client(channel)
            out = await client.run_request(player, "e2e", prompt, GREEDY)
            assert out.token_ids == player.reference(prompt, GREEDY)
            await blocks_back(client, 24)

    asyncio.run(body())


def test_kv_lease_flag_is_the_default_and_longest_lease(service: ServiceProcess) -> None:
    async def body() -> None:
        async with insecure_channel(service.address) as channel:
            client = Client(channel)
            await client.info()
            for asked, granted in [(0, LEASE_MS), (60_000, LEASE_MS), (300, 300)]:
                request = decode_pb2.GenerateRequest(
                    request_id=f"lease-{asked}",
                    prompt_token_ids=[5, 6, 7],
                    sampling=sampling(GREEDY),
                    kv_lease_ms=asked,
                )
                call = client.generate(request, timeout=10)
                admitted = (await call.read()).admitted
                assert admitted.kv_lease_ms == granted
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call.read()
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert granted / 1000 - 0.1 < time.monotonic() - started < granted / 1000 + 1.5
                await blocks_back(client, 24)

    asyncio.run(body())


def test_drain_fails_requests_waiting_for_kv_and_exits_zero(service: ServiceProcess) -> None:
    async def body() -> None:
        async with insecure_channel(service.address) as channel:
            client = Client(channel)
            await client.info()
            request = decode_pb2.GenerateRequest(
                request_id="drain",
                prompt_token_ids=[5, 6, 7],
                sampling=sampling(GREEDY),
            )
            call = client.generate(request, timeout=30)
            await call.read()  # admitted
            started = time.monotonic()
            service.proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            # No prefill can reach a draining server: the request fails now, not at its lease.
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 5.0

    asyncio.run(body())
    assert service.proc.wait(timeout=30) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-blocks", "0"], "--num-blocks must be > 0"),
        (["--watchdog-timeout", "-5"], "--watchdog-timeout must be >= 0, got -5.0"),
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
        (["--frontend", "decode-0"], "--frontend: 'decode-0' needs a port"),
    ],
)
def test_startup_errors_are_one_line(args: list[str], message: str, tiny_model_dir: Path) -> None:
    argv = ["--model", str(tiny_model_dir), *args] if args[0] != "--model" else args
    result = subprocess.run(
        [sys.executable, "-m", "mili", "serve-decode", "--port", "0", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert message in result.stderr


def test_frontend_and_prefill_flags_name_who_may_admit_and_pair(tiny_model_dir: Path) -> None:
    """Callers outside --frontend / --prefill (here: not 127.0.0.1) are refused; Info is open."""
    process = ServiceProcess(
        "serve-decode",
        "--model",
        str(tiny_model_dir),
        "--port",
        "0",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-blocks",
        "24",
        "--frontend",
        "127.0.0.9:50051",
        "--prefill",
        "127.0.0.9:50053",
    )

    async def body() -> None:
        async with insecure_channel(process.address) as channel:
            client = Client(channel)
            info = await client.info()
            request = decode_pb2.GenerateRequest(
                request_id="r", prompt_token_ids=[5, 6, 7], sampling=sampling(GREEDY)
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.generate(request, timeout=10).read()
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.kv.Pair(kv_pb2.PairRequest(host_id="h"), timeout=10)
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "--prefill 127.0.0.9:50053" in (caught.value.details() or "")
            assert (await client.info()).num_free_blocks == info.num_free_blocks

    try:
        asyncio.run(body())
    finally:
        assert process.terminate() == 0, process.stderr
