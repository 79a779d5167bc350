"""A taken port fails a start-up at once, before any model loads; TIME_WAIT does not count."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mili.errors import StartupError
from mili.ports import check_free, pick_free, pick_free_ports
from tests.service_process import ROOT


@pytest.fixture
def taken() -> Iterator[int]:
    """A port some other socket listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_listening_port_is_taken(taken: int) -> None:
    with pytest.raises(StartupError, match=f"--decode-port {taken}: 127.0.0.1:{taken} is already"):
        check_free("127.0.0.1", taken, "--decode-port")


def test_ports_picked_together_are_distinct() -> None:
    """mili serve names its decode instances' ports before they start: picked one by one and
    each probe closed, the kernel handed out the same port twice now and then (two decode
    instances, one failed to bind after loading its model)."""
    ports = pick_free_ports("127.0.0.1", 2000)
    assert len(set(ports)) == len(ports)
    for port in ports[:20]:
        check_free("127.0.0.1", port)
    assert isinstance(pick_free("127.0.0.1"), int)


def test_free_port_zero_and_time_wait_pass() -> None:
    check_free("127.0.0.1", 0)
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        server.listen()
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end goes to TIME_WAIT
        client.close()
    check_free("127.0.0.1", port)  # as the restarted child's gRPC bind will succeed


def test_a_port_shared_with_reuse_port_passes_only_a_sharer(taken: int) -> None:
    """`mili serve --frontends N`: a frontend joining its siblings' port passes the check;
    a port held without SO_REUSEPORT fails it all the same."""
    with socket.socket() as sibling:
        sibling.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sibling.bind(("127.0.0.1", 0))
        sibling.listen()
        port = sibling.getsockname()[1]
        check_free("127.0.0.1", port, reuse_port=True)
        with pytest.raises(StartupError, match="is already in use"):
            check_free("127.0.0.1", port)
    with pytest.raises(StartupError, match="is already in use"):
        check_free("127.0.0.1", taken, reuse_port=True)


def mili(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mili", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("command", ["serve-prefill", "serve-decode", "serve-tokenizer"])
def test_a_service_fails_before_loading_its_model(
    command: str, taken: int, demo_model_dir: Path
) -> None:
    result = mili(command, "--model", str(demo_model_dir), "--port", str(taken))
    assert result.returncode == 2
    # One line, and nothing logged before it: no model (or dtype) was loaded.
    assert result.stderr.strip().splitlines() == [
        f"mili {command}: error: --port {taken}: 127.0.0.1:{taken} is already in use by another "
        "process; stop it or choose another port (0 picks a free one)"
    ]


def test_serve_fails_before_starting_any_child(taken: int, demo_model_dir: Path) -> None:
    result = mili("serve", "--model", str(demo_model_dir), "--port", str(taken))
    assert result.returncode == 2
    assert f"--port {taken}: 127.0.0.1:{taken} is already in use" in result.stderr
    assert "[tokenizer]" not in result.stderr and "[decode-0]" not in result.stderr


def test_serve_checks_fixed_metrics_ports_too(taken: int, demo_model_dir: Path) -> None:
    # BASE+1 is the tokenizer's metrics port.
    result = mili(
        "serve", "--model", str(demo_model_dir), "--port", "0", "--metrics-port", str(taken - 1)
    )
    assert result.returncode == 2
    # (BASE itself, the frontend's, could be someone else's by chance: either is refused.)
    assert "--metrics-port" in result.stderr and "is already in use" in result.stderr
    assert "[tokenizer]" not in result.stderr


def test_the_http_api_may_not_share_the_grpc_port() -> None:
    """With --frontends N both would bind it (SO_REUSEPORT) and the kernel would split
    connections between HTTP and gRPC: refused before anything starts."""
    port = pick_free("127.0.0.1")
    for command in (["serve", "--frontends", "2"], ["serve-frontend", "--reuse-port"]):
        result = mili(*command, "--port", str(port), "--http-port", str(port))
        assert result.returncode == 2, result.stderr
        assert f"--http-port {port} is --port too" in result.stderr
        assert "[tokenizer]" not in result.stderr


def test_fixed_ports_that_are_one_fail_before_any_child(demo_model_dir: Path) -> None:
    """--metrics-port BASE counts up a port per child: BASE+1 (the tokenizer's) on the
    --http-port failed only once the models loaded, the frontend blaming "another process"."""
    port, http = pick_free("127.0.0.1"), pick_free("127.0.0.1")
    while http - 1 == port:  # BASE (the frontend's metrics port) must not be --port here
        http = pick_free("127.0.0.1")
    for flags, words in (
        (["--metrics-port", str(http - 1)], f"--metrics-port {http} is --http-port too"),
        (["--decode-port", str(port)], f"--decode-port {port} is --port too"),
    ):
        result = mili(
            "serve", "--model", str(demo_model_dir), "--port", str(port), "--http-port",
            str(http), *flags,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert words in result.stderr and "[tokenizer]" not in result.stderr


def test_a_derived_port_past_the_top_fails_before_any_child(demo_model_dir: Path) -> None:
    """Found by a flag review: --prefill-port 65535 with two instances, or --metrics-port
    65534, started the children, which then failed on port 65536."""
    result = mili(
        "serve", "--model", str(demo_model_dir), "--port", "0",
        "--prefill-port", "65535", "--prefill-instances", "2",
    )  # fmt: skip
    assert result.returncode == 2
    assert "--prefill-port 65536: a port must be in 1..65535" in result.stderr
    assert "[tokenizer]" not in result.stderr


def test_a_model_path_that_is_a_file_is_said_so(tmp_path: Path) -> None:
    """It said "does not exist" of a file that exists."""
    (tmp_path / "f").write_text("hi")
    result = mili("serve", "--model", str(tmp_path / "f"), "--port", "0")
    assert result.returncode == 2
    assert f"model directory {tmp_path / 'f'} is not a directory" in result.stderr
    result = mili("serve", "--model", str(tmp_path / "none"), "--port", "0")
    assert f"model directory {tmp_path / 'none'} does not exist" in result.stderr
