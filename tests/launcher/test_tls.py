"""`mili serve`'s TLS flags: what each child gets (--tls-*, --tls-demo), the launcher's health
checks of a child over mTLS, and one-line errors naming the flag for bad input; `mili bench`'s
--tls-* likewise. tests/e2e/test_serve_tls.py runs both for real."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import subprocess
import sys
from pathlib import Path

import pytest

from mili.errors import StartupError
from mili.rpc.certs import DEMO_STEMS, Authority, CertFiles, write_demo
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig, ServerTls
from mili.rpc.tls import TlsFiles
from mili.serve.child import _wait_for_health
from mili.serve.launcher import add_arguments
from mili.serve.plan import make_plan
from mili.serve.tls import demo_names, demo_usage
from tests.service_process import ROOT


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--decode-port", "1", *argv])  # a fixed port: no port probing


def _flag(argv: list[str], flag: str) -> str:
    """The value of the last `flag` in argv (argparse keeps the last)."""
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return Authority().write(tmp_path_factory.mktemp("pki"), "services", ["127.0.0.1"])


def test_given_tls_flags_reach_every_child_and_the_health_checks(
    tmp_path: Path, files: CertFiles
) -> None:
    tls = ("--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca))
    plan = make_plan(_args(*tls, "--public-tls", "tls"), tmp_path)
    children = [plan.tokenizer, *plan.prefills, *plan.decodes, *plan.frontends]
    for argv in children:
        assert _flag(argv, "--tls-cert") == str(files.cert)
        assert _flag(argv, "--tls-key") == str(files.key)
        assert _flag(argv, "--tls-ca") == str(files.ca)
    assert _flag(plan.frontend, "--public-tls") == "tls"
    assert plan.health_tls == TlsFiles(files.cert, files.key, files.ca).load()
    assert plan.frontend_health_tls == plan.health_tls
    plaintext = make_plan(_args(*tls, "--public-tls", "off"), tmp_path)
    assert _flag(plaintext.frontend, "--public-tls") == "off"
    assert plaintext.frontend_health_tls is None and plaintext.health_tls is not None
    assert plan.tls_demo is None
    assert make_plan(_args(), tmp_path).health_tls is None  # no flags: plaintext
    assert "--tls-cert" not in make_plan(_args(), tmp_path).tokenizer


def test_tls_demo_gives_each_service_its_own_certificate(tmp_path: Path) -> None:
    demo = write_demo(tmp_path / "pki", demo_names("127.0.0.1"))
    assert sorted(demo) == sorted(DEMO_STEMS)
    assert len({f.ca for f in demo.values()}) == 1  # one CA signed them all
    plan = make_plan(_args("--tls-demo"), tmp_path, demo)
    by_kind = {
        "tokenizer": plan.tokenizer,
        "prefill": plan.prefills[0],
        "decode": plan.decodes[0],
        "frontend": plan.frontend,
    }
    for kind, argv in by_kind.items():
        assert _flag(argv, "--tls-cert") == str(demo[kind].cert)
        assert _flag(argv, "--tls-key") == str(demo[kind].key)
        assert _flag(argv, "--tls-ca") == str(demo[kind].ca)  # mTLS between the services
    assert _flag(plan.frontend, "--public-tls") == "tls"  # clients need only the CA
    assert "--public-tls" not in plan.decodes[0]
    assert plan.tls_demo == demo["client"]
    assert plan.health_tls is not None and plan.health_tls.cert is not None
    with pytest.raises(StartupError, match="--tls-demo makes its own certificates"):
        make_plan(_args("--tls-demo", "--tls-ca", str(demo["client"].ca)), tmp_path, demo)
    assert demo_names("0.0.0.0") == ["localhost", "127.0.0.1", "::1", "0.0.0.0"]
    assert demo_names("[::1]") == ["localhost", "127.0.0.1", "::1"]


def test_tls_demo_usage_gives_a_curl_line_for_the_https_port_when_there_is_one(
    tmp_path: Path,
) -> None:
    client = write_demo(tmp_path, ["127.0.0.1"])["client"]
    lines = demo_usage(client, "127.0.0.1:50051", "https://127.0.0.1:8000")
    assert f"  curl --cacert {client.ca} https://127.0.0.1:8000/v1/models" in lines
    no_http = demo_usage(client, "127.0.0.1:50051")
    assert not [line for line in no_http if line.strip().startswith("curl ")]


def test_bad_tls_flags_fail_with_a_line_naming_the_flag(tmp_path: Path, files: CertFiles) -> None:
    cert_and_key = ("--tls-cert", str(files.cert), "--tls-key", str(files.key))
    for argv, message in [
        (("--tls-cert", "/nonexistent/a.crt", "--tls-key", str(files.key)), "--tls-cert /nonex"),
        ((*cert_and_key, "--tls-ca", "/nonexistent/ca.crt"), "--tls-ca /nonexistent/ca.crt: No"),
        (("--tls-cert", str(files.cert)), "--tls-cert and --tls-key go together"),
        (("--tls-ca", str(files.ca)), "--tls-ca needs --tls-cert and --tls-key"),
        (cert_and_key, None),  # TLS without client certificates: fine
    ]:
        if message is None:
            make_plan(_args(*argv), tmp_path)
            continue
        with pytest.raises(StartupError, match=message):
            make_plan(_args(*argv), tmp_path)


def test_health_checks_of_a_child_speak_its_mtls(files: CertFiles) -> None:
    tls = TlsFiles(files.cert, files.key, files.ca).load()

    async def main() -> tuple[str, str]:
        server = RpcServer(
            ServerConfig(tls=ServerTls(tls, require_client_auth=True), drain_timeout_s=0.2),
            name="t",
        )
        port = await server.start()
        try:
            address = f"127.0.0.1:{port}"
            return (
                await _wait_for_health(address, ("SERVING",), 5.0, tls),
                await _wait_for_health(address, ("SERVING",), 1.0),
            )
        finally:
            await server.drain()

    with_tls, plaintext = asyncio.run(main())
    assert with_tls == "SERVING"
    assert plaintext.startswith("UNAVAILABLE") and "require TLS" in plaintext, plaintext


@pytest.mark.parametrize(
    ("names", "valid", "details", "hint"),
    [
        (
            ["wrong.example.com"],
            datetime.timedelta(days=1),
            "Hostname Verification Check failed",
            "does not name the host dialed",
        ),
        (["127.0.0.1"], -datetime.timedelta(days=1), "certificate has expired", "has expired"),
    ],
)
def test_health_checks_name_a_certificate_the_dialed_host_cannot_use(
    tmp_path: Path, names: list[str], valid: datetime.timedelta, details: str, hint: str
) -> None:
    authority = Authority()
    served = TlsFiles(*_paths(authority.write(tmp_path, "served", names, valid))).load()
    client = TlsFiles(*_paths(authority.write(tmp_path, "client", ["127.0.0.1"]))).load()

    async def main() -> str:
        config = ServerConfig(tls=ServerTls(served, require_client_auth=True), drain_timeout_s=0.2)
        server = RpcServer(config, name="t")
        port = await server.start()
        try:
            return await _wait_for_health(f"127.0.0.1:{port}", ("SERVING",), 1.0, client)
        finally:
            await server.drain()

    last = asyncio.run(main())
    assert last.startswith("UNAVAILABLE: ") and details in last and hint in last, last
    assert "failed to connect to all addresses" not in last  # grpc's detail, briefly


def _paths(files: CertFiles) -> tuple[Path, Path, Path]:
    return files.cert, files.key, files.ca


def _mili(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mili", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def test_serve_with_a_missing_certificate_fails_in_one_line(demo_model_dir: Path) -> None:
    result = _mili(
        "serve", "--model", str(demo_model_dir), "--port", "0",
        "--tls-cert", "/nonexistent/serve.crt", "--tls-key", "/nonexistent/serve.key",
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mili serve: error: --tls-cert /nonexistent/serve.crt: No such file or directory"
    ], result.stderr
    assert "listening" not in result.stdout  # failed before starting any child


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--tls-ca", "/nonexistent/ca.crt"], "--tls-ca /nonexistent/ca.crt: No such file"),
        (["--tls-key", "/nonexistent/k.key"], "--tls-cert and --tls-key go together"),
    ],
)
def test_bench_with_bad_tls_flags_fails_in_one_line(argv: list[str], line: str) -> None:
    result = _mili("bench", "--address", "127.0.0.1:1", *argv)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mili bench: error: ") and line in lines[0]


def test_a_certificate_that_cannot_work_fails_before_any_child_starts(tmp_path: Path) -> None:
    """Found by an exploratory test: each waited out the start-up timeout (60 s), then said
    only that the tokenizer was not SERVING."""
    ca = Authority()
    other = Authority("another CA")
    good = ca.write(tmp_path / "good", "services", ["127.0.0.1"])
    wildcard = ca.write(tmp_path / "wild", "services", ["*.mili.test"])
    for files, host, problem in [
        (ca.write(tmp_path / "wrong", "services", ["wrong.example.com"]), "127.0.0.1",
         "it does not name --host 127.0.0.1"),
        (ca.write(tmp_path / "old", "services", ["127.0.0.1"], datetime.timedelta(hours=-1)),
         "127.0.0.1", "expired on "),
        (other.write(tmp_path / "other", "services", ["127.0.0.1"]), "127.0.0.1",
         "not signed by --tls-ca"),
        (wildcard, "deep.a.mili.test", "it does not name --host deep.a.mili.test"),
    ]:  # fmt: skip
        tls = ("--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(good.ca))
        with pytest.raises(StartupError, match=f"--tls-cert {files.cert}: {problem}"):
            make_plan(_args("--host", host, *tls), tmp_path)
    for files, host in [(good, "127.0.0.1"), (wildcard, "a.mili.test"), (good, "0.0.0.0")]:
        tls = ("--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(good.ca))
        make_plan(_args("--host", host, *tls), tmp_path)  # fine
