"""Prefill sends KV only to decode instances it may talk to: the destination a Prefill call names
must be in the instance's --decode list, or the call is PERMISSION_DENIED before any connection
is made (anyone who reaches the port can call Prefill and name any address)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mili.discovery import ANY, PeerSet
from mili.ports import pick_free
from services.prefill.config import PrefillConfig
from tests.prefill.harness import (
    TINY,
    TinyModel,
    prefill_request,
    prefill_service,
    random_ids,
    receiver_cache,
)
from tests.prefill.receiver import KvReceiver, serve_receiver

ROOT = Path(__file__).resolve().parents[2]


def test_the_allowed_list() -> None:
    """--decode as PeerSet reads it: fixed addresses as spelled (host case and leading zeros
    aside), looked up never; nothing allowed when empty, anything with '*' alone."""
    looked_up: list[str] = []

    async def resolve(host: str) -> tuple[str, ...]:
        looked_up.append(host)
        return ("10.0.0.1",)

    async def allowed(values: tuple[str, ...], address: str) -> bool:
        PrefillConfig(allowed_decodes=values)  # the config accepts what the set is made of
        return await PeerSet.parse(values, resolve=resolve).has_address(address)

    async def main() -> None:
        fixed = ("127.0.0.1:5000", "Decode:6000")
        assert await allowed(fixed, "127.0.0.1:5000") and await allowed(fixed, "decode:06000")
        for other in ("127.0.0.1:5001", "127.0.0.2:5000", "127.0.0.1:1", "garbage", ""):
            assert not await allowed(fixed, other), other
        assert looked_up == []  # no DNS entry: nothing to look up, however many checks
        assert not await allowed((), "127.0.0.1:5000")  # empty: none
        assert await allowed((ANY,), "x:1")
        assert await allowed(("dns:///decode:6000",), "10.0.0.1:6000")
        assert looked_up == ["decode"]
        # Beside a DNS entry, a fixed name is still not looked up (found by a review of
        # 482e1e1: one that did not resolve was a WARNING, every refresh, inside the check)
        looked_up.clear()
        both = ("decode-fixed.example:5000", "dns:///decode:6000")
        assert await allowed(both, "10.0.0.1:6000") and await allowed(both, both[0])
        assert looked_up == ["decode"]

    asyncio.run(main())
    for bad in (("decode-0",), ("*", "127.0.0.1:5000")):
        with pytest.raises(ValueError, match="allowed decodes"):
            PrefillConfig(allowed_decodes=bad)


@contextlib.contextmanager
def counting_listener() -> Iterator[tuple[str, list[int]]]:
    """A TCP port that counts the connections made to it."""
    accepted: list[int] = []
    stop = threading.Event()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.05)

        def accept() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                accepted.append(1)
                conn.close()

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            yield f"127.0.0.1:{listener.getsockname()[1]}", accepted
        finally:
            stop.set()
            thread.join(timeout=2)


def test_a_destination_not_allowed_is_refused_before_any_connection(tiny: TinyModel) -> None:
    prompt = random_ids(40, TINY.vocab_size, seed=3)
    port = pick_free("127.0.0.1")
    allowed = f"127.0.0.1:{port}"

    async def main() -> None:
        with counting_listener() as (stranger, accepted):
            async with prefill_service(tiny, allowed_decodes=(allowed,)) as h:
                for address in (stranger, "127.0.0.1:1", "garbage", f"127.0.0.1:{port + 1}"):
                    request = prefill_request("nope", prompt, address, [1, 2, 3])
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await h.stub.Prefill(request, timeout=10)
                    assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED, address
                    assert "--decode" in (info.value.details() or "")
                    assert allowed not in (info.value.details() or "")  # the list stays ours
                # The allowed destination works.
                receiver = KvReceiver(h.servicer.layout, receiver_cache(tiny))
                receiver.reserve("ok", [1, 2, 3])
                async with serve_receiver(receiver, port=port):
                    request = prefill_request("ok", prompt, allowed, [1, 2, 3])
                    reply = await h.stub.Prefill(request, timeout=30)
                assert reply.num_prompt_tokens == 40
                assert receiver.transfers["ok"].status == "ok"
            await asyncio.sleep(0.2)
            assert accepted == []  # never dialled

    asyncio.run(main())


def test_serve_prefill_without_decode_list_is_a_one_line_error(tiny: TinyModel) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mili", "serve-prefill", "--model", str(tiny.path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--decode is required" in result.stderr
