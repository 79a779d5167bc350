"""TokenizerBackend's log when the tokenizer is never reachable: the reason, once per reason."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from mili.pb.tokenizer.v1 import tokenizer_pb2_grpc
from mili.rpc.client import channel
from services.frontend.tokenizer_backend import TokenizerBackend


def test_a_tokenizer_never_up_logs_why_once(caplog: pytest.LogCaptureFixture) -> None:
    # Bound but not listening: the port stays ours and refuses every connection.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"

        async def main() -> None:
            async with channel(address) as ch:
                stub = tokenizer_pb2_grpc.TokenizerServiceStub(ch)
                backend = TokenizerBackend(address, stub, info_timeout_s=2.0)
                for _ in range(3):
                    await backend.poll()
                assert backend.facts is None

        with caplog.at_level(logging.INFO, logger="mili.frontend"):
            asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "mili.frontend"]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"tokenizer at {address} does not answer: UNAVAILABLE: "), lines
    assert "Connection refused" in lines[0], lines
