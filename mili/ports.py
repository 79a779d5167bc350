"""Checking a listening port is free before the slow part of a start-up.

Loading a model takes seconds to minutes; a port that is taken should fail the start in well
under a second, before the load, not after it. The check binds a throwaway socket the way the
gRPC server will (SO_REUSEADDR, so connections left in TIME_WAIT by a previous run do not
count; SO_REUSEPORT only for a port processes share) and closes it again. Another process can
still take the port between the check and the real bind; that bind then fails as before, just
later.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Sequence

from mili.discovery import format_address
from mili.errors import StartupError


def pick_free(host: str) -> int:
    """A port nothing listens on now (see pick_free_ports)."""
    return pick_free_ports(host, 1)[0]


def pick_free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports nothing listens on now, for children that must be named before
    they start (a prefill instance is told its decode instances' addresses up front). Each
    probe stays bound until all are picked: closed one by one, the kernel may hand the same
    port out twice. Another process could take one before its child binds; that child's start
    then fails with a clear error."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with contextlib.ExitStack() as probes:
        ports = []
        for _ in range(count):
            probe = probes.enter_context(socket.socket(family, socket.SOCK_STREAM))
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host.strip("[]"), 0))
            ports.append(int(probe.getsockname()[1]))
        return ports


def check_free(host: str, port: int, flag: str = "--port", *, reuse_port: bool = False) -> None:
    """StartupError naming `flag` when nothing may listen on host:port; port 0 always passes.
    `reuse_port`: a port that processes share with SO_REUSEPORT passes while they hold it."""
    if port == 0:
        return
    if not 0 < port <= 65535:  # (a base flag plus its instance offset may pass the top)
        raise StartupError(f"{flag} {port}: a port must be in 1..65535")
    where = format_address(host, port)
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise StartupError(f"{flag} {port}: cannot resolve {host!r}: {e}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:  # as gRPC binds: IPv6 and IPv4 checked separately
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:  # e.g. "localhost" on a host without IPv6
                    continue
                if e.errno == errno.EADDRINUSE:
                    raise StartupError(
                        f"{flag} {port}: {where} is already in use by another process; stop "
                        "it or choose another port (0 picks a free one)"
                    ) from None
                raise StartupError(f"{flag} {port}: cannot listen on {where}: {e}") from None


def check_distinct(fixed: Sequence[tuple[str, int]]) -> None:
    """StartupError when two fixed ports (flag, port; 0: any free one) are one: a child would
    find its port taken by a sibling once the models loaded, and the HTTP API on the gRPC port
    binds both with SO_REUSEPORT (--frontends N), the kernel then splitting connections
    between them."""
    named: dict[int, str] = {}
    for flag, port in fixed:
        if port and port in named:
            derived = " (--metrics-port counts up from BASE, a port per child)"
            raise StartupError(
                f"{flag} {port} is {named[port]} too: each needs a port of its own"
                + (derived if "--metrics-port" in (flag, named[port]) else "")
            )
        named.setdefault(port, flag)
