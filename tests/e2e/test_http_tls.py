"""TLS on the frontend's HTTP port, with the same --tls-* files as its gRPC port: HTTPS to a
client that trusts the CA, plaintext refused; with --public-tls mtls, a client without a
certificate refused and one holding a certificate the CA signed answered."""

from __future__ import annotations

import http.client
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from mili.rpc.certs import CertFiles, write_demo
from tests.e2e.conftest import start_all
from tests.service_process import ServiceProcess

# Backends on ports nothing listens on (below 1024: nothing unprivileged binds them):
# /v1/models needs none.
NO_BACKENDS = ("--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2", "--decode", "127.0.0.1:3")


def _frontend(server: CertFiles, *argv: str) -> list[str]:
    return [
        "serve-frontend", "--port", "0", "--http-port", "0", *NO_BACKENDS,
        "--tls-cert", str(server.cert), "--tls-key", str(server.key), *argv,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    return write_demo(tmp_path_factory.mktemp("tls"), ["localhost", "127.0.0.1"])


@pytest.fixture(scope="module")
def frontends(certs: dict[str, CertFiles]) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    server = certs["frontend"]
    tls, mtls = start_all(
        [
            _frontend(server, "--public-tls", "tls"),
            _frontend(server, "--tls-ca", str(server.ca), "--public-tls", "mtls"),
        ]
    )
    try:
        yield tls, mtls
    finally:
        for service in (tls, mtls):
            assert service.terminate() == 0, service.stderr[-3000:]


def _models(url: str, context: ssl.SSLContext | None = None) -> int:
    with urllib.request.urlopen(f"{url}/v1/models", context=context, timeout=10) as response:
        assert response.headers["X-Request-Id"]
        status: int = response.status
        return status


def _trusting(certs: dict[str, CertFiles], client: CertFiles | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs["client"].ca))  # verifies the cert
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return context


def test_https_with_the_ca_and_plaintext_refused(
    frontends: tuple[ServiceProcess, ServiceProcess], certs: dict[str, CertFiles]
) -> None:
    tls, _ = frontends
    url = tls.http_url
    assert url.startswith("https://127.0.0.1:"), url
    assert _models(url, _trusting(certs)) == 200
    # A client that does not trust the CA refuses the server's certificate.
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _models(url, ssl.create_default_context())
    # Plaintext on the TLS port gets no HTTP answer.
    plain = url.replace("https://", "http://")
    with pytest.raises((http.client.HTTPException, OSError)):
        _models(plain)


def test_mtls_refuses_a_client_without_a_certificate_and_answers_one_the_ca_signed(
    frontends: tuple[ServiceProcess, ServiceProcess], certs: dict[str, CertFiles]
) -> None:
    _, mtls = frontends
    url = mtls.http_url
    assert url.startswith("https://"), url
    with pytest.raises((ssl.SSLError, urllib.error.URLError, OSError)):
        _models(url, _trusting(certs))
    assert _models(url, _trusting(certs, certs["client"])) == 200
    # A certificate another CA signed is refused as well.
    other = write_demo(Path(certs["client"].cert).parent / "other", ["localhost"])
    with pytest.raises((ssl.SSLError, urllib.error.URLError, OSError)):
        _models(url, _trusting(certs, other["client"]))
