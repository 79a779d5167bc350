"""TLS on a real RpcServer: an mTLS port admits only clients holding a certificate its CA
signed, refuses others at the handshake (fast, UNAVAILABLE), tells a plaintext client what is
wrong; the plaintext --health-port answers probes and keeps 'liveness' through a drain; the
--tls-* flags fit together or say why not."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mili import flags
from mili.client import generate
from mili.rpc.certs import Authority, CertFiles
from mili.rpc.client import channel, connection_hint
from mili.rpc.server import LIVENESS, RpcServer
from mili.rpc.server_config import ServerConfig, ServerTls
from mili.rpc.tls import Tls, TlsFiles
from tests.rpc.conftest import EchoServer, eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _load(files: CertFiles, *, with_cert: bool = True, ca: Path | None = None) -> Tls:
    cert, key = (files.cert, files.key) if with_cert else (None, None)
    return TlsFiles(cert=cert, key=key, ca=ca or files.ca).load()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    ours, theirs = Authority(), Authority("someone else's CA")
    root = tmp_path_factory.mktemp("pki")
    return {
        "server": ours.write(root / "ours", "server", ["localhost", "127.0.0.1"]),
        "client": ours.write(root / "ours", "client", ["frontend"]),
        "stranger": theirs.write(root / "theirs", "client", ["frontend"]),
    }


async def _check(address: str, tls: Tls | None, service: str = "") -> int:
    async with channel(address, tls=tls) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return int(reply.status)


async def _refused(address: str, tls: Tls | None) -> tuple[grpc.aio.AioRpcError, float]:
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _check(address, tls)
    return info.value, time.monotonic() - started


def test_an_mtls_port_admits_only_certificates_its_ca_signed(pki: dict[str, CertFiles]) -> None:
    async def main() -> None:
        server_tls = ServerTls(_load(pki["server"]), require_client_auth=True)
        server = RpcServer(ServerConfig(tls=server_tls, drain_timeout_s=0.2), name="t")
        port = await server.start()
        address = f"127.0.0.1:{port}"
        try:
            assert await _check(address, _load(pki["client"])) == SERVING
            for tls in (
                _load(pki["stranger"], ca=pki["server"].ca),  # a certificate we did not sign
                _load(pki["client"], with_cert=False),  # TLS, but no certificate
            ):
                err, elapsed_s = await _refused(address, tls)
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert elapsed_s < 2.0  # refused at the handshake, not timed out
                assert "TLS handshake" in connection_hint(err, is_tls=True)
            # A client that does not trust our CA refuses the server in its turn.
            err, _ = await _refused(address, _load(pki["stranger"]))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "check --tls-ca" in connection_hint(err, is_tls=True)
            # Plaintext against TLS: fast, with a hint that says what to do.
            err, elapsed_s = await _refused(address, None)
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert elapsed_s < 2.0
            assert "require TLS" in connection_hint(err, is_tls=False)
        finally:
            await server.drain()

    asyncio.run(main())


def test_plain_tls_port_admits_clients_without_certificates(pki: dict[str, CertFiles]) -> None:
    async def main() -> None:
        server_tls = ServerTls(_load(pki["server"]), require_client_auth=False)
        server = RpcServer(ServerConfig(tls=server_tls, drain_timeout_s=0.2), name="t")
        port = await server.start()
        try:
            no_cert = _load(pki["client"], with_cert=False)
            assert await _check(f"localhost:{port}", no_cert) == SERVING
        finally:
            await server.drain()

    asyncio.run(main())


def test_mili_generate_in_plaintext_against_a_tls_port_says_so(
    pki: dict[str, CertFiles], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)

    async def main() -> int:
        server_tls = ServerTls(_load(pki["server"]), require_client_auth=True)
        server = RpcServer(ServerConfig(tls=server_tls, drain_timeout_s=0.2), name="t")
        port = await server.start()
        try:
            args = parser.parse_args(["hi", "--address", f"127.0.0.1:{port}", "--timeout", "5"])
            started = time.monotonic()
            code = await asyncio.to_thread(generate.run, args)
            assert time.monotonic() - started < 3.0
            return code
        finally:
            await server.drain()

    assert asyncio.run(main()) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "does it require TLS? pass --tls-ca" in err, err


def test_the_health_port_serves_probes_in_plaintext_and_liveness_survives_a_drain(
    echo_server: EchoServer,
) -> None:
    async def main() -> None:
        config = ServerConfig(health_port=0, drain_timeout_s=5.0, grace_s=0.1)
        async with echo_server(config) as h:
            probe = h.server.health_address
            assert probe is not None
            assert await _check(probe, None) == SERVING
            assert await _check(probe, None, LIVENESS) == SERVING
            held = h.server_stream("Hold")(b"x")
            assert await held.read() == b"started"
            drained = asyncio.create_task(h.server.drain())
            await eventually(lambda: h.server.is_draining)
            # Draining: not ready (no new work), but alive (no restart).
            await eventually(lambda: _is(probe, "", NOT_SERVING))
            assert await _check(probe, None, LIVENESS) == SERVING
            h.echo.release.set()
            await drained

    asyncio.run(main())


async def _is(address: str, service: str, status: int) -> bool:
    return await _check(address, None, service) == status


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    flags.add_server_arguments(parser, 1)
    return parser.parse_args(argv)


def test_tls_flags_fit_together_or_say_why_not(pki: dict[str, CertFiles]) -> None:
    files = pki["server"]
    cert, key, ca = str(files.cert), str(files.key), str(files.ca)
    assert flags.server_config(_args()).tls is None
    tls = flags.server_config(_args("--tls-cert", cert, "--tls-key", key)).tls
    assert tls is not None and not tls.require_client_auth
    tls = flags.server_config(_args("--tls-cert", cert, "--tls-key", key, "--tls-ca", ca)).tls
    assert tls is not None and tls.require_client_auth
    with pytest.raises(ValueError, match="go together"):
        flags.server_config(_args("--tls-cert", cert))
    with pytest.raises(ValueError, match="--tls-ca /nonexistent"):
        flags.server_config(_args("--tls-cert", cert, "--tls-key", key, "--tls-ca", "/nonexistent"))
    with pytest.raises(ValueError, match="not a PEM file"):
        flags.server_config(_args("--tls-cert", cert, "--tls-key", key, "--tls-ca", __file__))
    # Found by a flag review: a key of another certificate was "cannot listen ...; is it in
    # use?" (grpc only failed to bind).
    other_key = str(pki["client"].key)
    with pytest.raises(ValueError, match=f"--tls-key {other_key} is not the key of --tls-cert"):
        flags.server_config(_args("--tls-cert", cert, "--tls-key", other_key))
    # A client with only --tls-ca verifies servers and presents nothing.
    client = flags.client_tls(_args("--tls-ca", ca))
    assert client is not None and client.cert is None
