"""`mili serve-prefill` as an operator runs it: start-up log, Info, a prefill, clean exit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from mili.engine.model.kv_cache import KVCache
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from mili.rpc.client import insecure_channel
from tests.prefill.harness import TINY, TinyModel, prefill_request, random_ids
from tests.prefill.receiver import KvReceiver, serve_receiver
from tests.service_process import ServiceProcess

ROOT = Path(__file__).resolve().parents[2]


def test_serve_prefill_process(tiny: TinyModel) -> None:
    service = ServiceProcess(
        "serve-prefill",
        "--model",
        str(tiny.path),
        "--port",
        "0",
        "--num-blocks",
        "48",
        "--max-batch-tokens",
        "64",
        "--decode",
        "*",  # the stand-in decode below listens on a port chosen later
    )
    try:
        prompt = random_ids(40, TINY.vocab_size, seed=9)

        async def main() -> tuple[prefill_pb2.InfoResponse, prefill_pb2.PrefillResponse]:
            async with insecure_channel(service.address) as channel:
                stub = prefill_pb2_grpc.PrefillServiceStub(channel)
                info = await stub.Info(prefill_pb2.InfoRequest())
                cache = KVCache(TINY, 8, 16)
                receiver = KvReceiver(info.kv_layout, cache)
                receiver.reserve("cli", [5, 6, 7])
                async with serve_receiver(receiver) as server:
                    request = prefill_request("cli", prompt, server.address, [5, 6, 7])
                    reply = await stub.Prefill(request, timeout=30)
                assert receiver.transfers["cli"].status == "ok"
                after = await stub.Info(prefill_pb2.InfoRequest())
                assert after.num_free_blocks == after.num_total_blocks == 48
                return info, reply

        info, reply = asyncio.run(main())
    finally:
        code = service.terminate()
    assert code == 0, service.stderr
    assert info.model == "tiny" and info.device == "cpu" and info.dtype == "float32"
    assert info.kv_layout.model_fingerprint == tiny.fingerprint
    assert (info.max_batch_tokens, info.num_total_blocks, info.attention_backend) == (
        64,
        48,
        "mojo",  # the default (auto) where the kernels build: this model's head_dim is 64
    )
    assert reply.num_prompt_tokens == 40 and reply.kv_bytes > 0
    started = [line for line in service.stderr_lines if "prefill for" in line]
    assert len(started) == 1, service.stderr
    for word in (str(tiny.path), "on cpu", "dtype float32", "48 KV blocks", "attention mojo"):
        assert word in started[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nowhere/model"], "does not exist"),
        (["--max-batch-tokens", "8"], "max_batch_tokens (8) must be >= block_size (16)"),
        (["--device", "tpu:7"], "tpu"),
    ],
)
def test_bad_start_up_is_one_line_error(tiny: TinyModel, args: list[str], message: str) -> None:
    command = [sys.executable, "-m", "mili", "serve-prefill", "--model", str(tiny.path)]
    result = subprocess.run(
        [*command, "--port", "0", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert message in result.stderr
