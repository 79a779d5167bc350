"""tests/netns.py: hosts reach each other and this process over the bridge, see our files, and
nothing (namespace, veth, bridge, process) is left after close, failures included; where
namespaces cannot be made, the reason to skip says why."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests import netns

_REASON = netns.unavailable()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

# Run inside a host: serve one TCP connection on port 7000, answering with the file's contents.
_SERVE = """
import socket, sys
with socket.create_server((sys.argv[1], 7000)) as s:
    print("ready", flush=True)
    conn, peer = s.accept()
    conn.sendall(open(sys.argv[2], "rb").read() + b" to " + peer[0].encode())
    conn.close()
"""

_CONNECT = """
import socket, sys
with socket.create_connection((sys.argv[1], 7000), timeout=5) as c:
    print(c.recv(100).decode())
"""


@needs_netns
def test_hosts_reach_each_other_and_us_and_see_our_files() -> None:
    # In /dev/shm: `ip netns exec` gives the child a mount namespace of its own, and the
    # same-host KV transports need it to see our shared memory (and the model directory).
    message = Path("/dev/shm") / f"mili-netns-test-{os.getpid()}"
    message.write_text("hello")
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(message.unlink)
        net = cleanup.enter_context(netns.Network())
        server, client = net.add_host("a"), net.add_host("b")
        assert server.ip != client.ip
        proc = subprocess.Popen(
            server.command([sys.executable, "-c", _SERVE, server.ip, str(message)]),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        reply = subprocess.run(
            client.command([sys.executable, "-c", _CONNECT, server.ip]),
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        # The peer address is the client's own IP: it came across the bridge, not via lo.
        assert reply.stdout.strip() == f"hello to {client.ip}"
        proc.wait(10)
        # This (root) namespace reaches a host too, and a host's port is not ours.
        proc = subprocess.Popen(
            server.command([sys.executable, "-c", _SERVE, server.ip, str(message)]),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        with socket.create_connection((server.ip, 7000), timeout=5) as conn:
            assert conn.recv(100).decode() == f"hello to {net.gateway}"
        proc.wait(10)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", 7000), timeout=1).close()
    assert netns.leftovers(net.tag, net.prefix) == []


@needs_netns
def test_close_after_a_failure_kills_what_runs_inside_and_removes_everything() -> None:
    with pytest.raises(RuntimeError, match="boom"), netns.Network() as net:
        host = net.add_host("a")
        sleeper = subprocess.Popen(host.command(["sleep", "300"]))
        assert netns.leftovers(net.tag, net.prefix) != []
        raise RuntimeError("boom")
    assert sleeper.wait(10) == -9  # killed by close(), so the namespace could go
    assert netns.leftovers(net.tag, net.prefix) == []


@needs_netns
def test_namespaces_get_names_of_their_own() -> None:
    with netns.Network() as first, netns.Network() as second:
        assert first.prefix != second.prefix and first.tag != second.tag
        assert first.gateway != second.gateway
        assert len(f"{first.tag}v250") <= 15  # Linux's limit on interface names
    assert netns.leftovers(first.tag, first.prefix) == []
    assert netns.leftovers(second.tag, second.prefix) == []


def test_without_root_the_reason_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where tests skip, they say why (here: not root), and nothing was created trying."""
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.shutil, "which", lambda name: "/usr/sbin/ip")
    assert netns.unavailable() == (
        "creating network namespaces needs root (CAP_NET_ADMIN); run as root"
    )
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert netns.unavailable() == "the `ip` command (iproute2) is not installed"
