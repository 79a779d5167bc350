"""The frontend over mTLS, against fakes (fakes.py) on real mTLS servers: a decode instance
found through dns:///NAME:PORT is dialled by IP and verified as NAME (its certificate names no
IP); an instance that refuses the frontend's certificate stays down, logged once with a hint,
not at every poll."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from mili.pb.decode.v1 import decode_pb2_grpc
from mili.pb.prefill.v1 import prefill_pb2_grpc
from mili.pb.tokenizer.v1 import tokenizer_pb2_grpc
from mili.ports import pick_free
from mili.rpc.certs import Authority
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig, ServerTls
from mili.rpc.tls import Tls, TlsFiles
from services.frontend.backends import Backends
from services.frontend.config import FrontendConfig
from services.frontend.router import Router
from tests.frontend.fakes import FakeDecode, FakePrefill, FakeTokenizer, wait_until

NAME = "decode.mili.test"
IP = "127.0.0.2"


async def _serve(tls: Tls, service: str, register: Any, host: str, port: int) -> RpcServer:
    config = ServerConfig(
        host=host,
        port=port,
        tls=ServerTls(tls, require_client_auth=True),
        drain_timeout_s=0.2,
        grace_s=0.1,
    )
    server = RpcServer(config, name=service.rsplit(".", 1)[-1])
    server.add_service(service, register)
    await server.start()
    return server


async def _backends_against(tmp_path: Path, frontend_ca: Authority, ca: Authority) -> Backends:
    """Tokenizer and prefill on 127.0.0.1, decode on IP, all mTLS with certificates from `ca`
    (decode's names only NAME); a frontend holding a certificate from `frontend_ca`."""
    services = ca.write(tmp_path / "ours", "services", ["localhost", "127.0.0.1", NAME])
    decode_files = ca.write(tmp_path / "ours", "decode", [NAME])
    frontend = frontend_ca.write(tmp_path / "frontend", "frontend", ["frontend"])
    tls = TlsFiles(services.cert, services.key, services.ca).load()
    decode_tls = TlsFiles(decode_files.cert, decode_files.key, decode_files.ca).load()
    port = pick_free(IP)
    servers = [
        await _serve(
            tls,
            "mili.tokenizer.v1.TokenizerService",
            lambda s: tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(FakeTokenizer(), s),
            "127.0.0.1",
            0,
        ),
        await _serve(
            tls,
            "mili.prefill.v1.PrefillService",
            lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(FakePrefill(), s),
            "127.0.0.1",
            0,
        ),
        await _serve(
            decode_tls,
            "mili.decode.v1.DecodeService",
            lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(FakeDecode(), s),
            IP,
            port,
        ),
    ]

    async def resolve(host: str) -> tuple[str, ...]:
        return (IP,) if host == NAME else ()

    config = FrontendConfig(
        tokenizer_address=f"localhost:{servers[0].port}",
        prefill_addresses=(f"127.0.0.1:{servers[1].port}",),
        decode_addresses=(f"dns:///{NAME}:{port}",),
        poll_interval_s=0.05,
        resolve_interval_s=0.1,
        info_timeout_s=0.5,
    )
    # The frontend trusts `ca` (servers' certificates) and presents its own.
    frontend_tls = TlsFiles(frontend.cert, frontend.key, services.ca).load()
    backends = Backends(config, Router(), tls=frontend_tls, resolve=resolve)
    backends.servers = servers  # type: ignore[attr-defined]
    return backends


async def _close(backends: Backends) -> None:
    await backends.close()
    for server in backends.servers:  # type: ignore[attr-defined]
        await server.drain()


def test_an_instance_found_by_name_is_verified_as_that_name(tmp_path: Path) -> None:
    async def main() -> None:
        ca = Authority()
        backends = await _backends_against(tmp_path, ca, ca)
        try:
            await backends.start()
            decode = f"{IP}:{backends.instances.targets('decode')[0].port}"
            await wait_until(lambda: backends.router.decodes[decode].is_routable, 2.0)
            assert backends.problem is None
        finally:
            await _close(backends)

    asyncio.run(main())


def test_an_instance_refusing_our_certificate_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        backends = await _backends_against(tmp_path, Authority("someone else's CA"), Authority())
        try:
            with caplog.at_level(logging.WARNING, logger="mili.frontend"):
                await backends.start()
                await asyncio.sleep(0.6)  # a dozen polls, each refused at the handshake
            decode = f"{IP}:{backends.instances.targets('decode')[0].port}"
            assert not backends.router.decodes[decode].is_up
            lines = [r.getMessage() for r in caplog.records if decode in r.getMessage()]
            refusals = [line for line in lines if "UNAVAILABLE" in line]
            assert len(refusals) == 1, lines
            assert "TLS handshake" in refusals[0], refusals[0]
        finally:
            await _close(backends)

    asyncio.run(main())
