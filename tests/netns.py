"""Linux network namespaces as "hosts" on one machine: a bridge in this (the root) namespace
and, per host, a namespace joined to it by a veth pair whose inside end carries the host's IP.

     root namespace (this process)               namespace <prefix>-<name>
     bridge <tag>b  10.213.N.1/24 ── <tag>v<i> ══ eth0 10.213.N.(2+i)/24, lo up

    reason = unavailable()                       # None, or why namespaces cannot be made here
    with Network() as net:
        host = net.add_host("decode-0")          # namespace mili-t<pid>-<k>-decode-0
        subprocess.Popen(host.command([sys.executable, "-m", "mili", ...]))
    assert leftovers(net.tag, net.prefix) == []  # gone, also after an exception

This process reaches every host through the bridge's address (the route comes with it), and
hosts reach each other across the bridge. `ip netns exec` also gives the child a mount
namespace of its own, but a copy of ours (only /sys is remounted): /dev/shm, the model and
temporary directories stay the same files.

Names are unique per process and Network (`mili-t<pid>-<k>` namespaces, `mt<pid hex><k>`
interfaces: Linux allows 15 characters), so parallel runs do not collide; the /24 is the first
10.213.N.0/24 no route of this machine covers.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

_COUNTER = itertools.count()
_SUBNET_BASE = "10.213"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (a sentence for pytest.skip), or None."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN); run as root"
    probe = f"mili-probe-{os.getpid()}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"`ip netns add` failed (no CAP_NET_ADMIN?): {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its IP on the bridge."""

    name: str
    namespace: str
    ip: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace (ip execs it: the pid is argv's own)."""
        return ["ip", "netns", "exec", self.namespace, *argv]


class Network:
    """A bridge and namespaces on it; `close` (or leaving the `with`) removes all of them."""

    def __init__(self) -> None:
        k = next(_COUNTER)
        self.prefix = f"mili-t{os.getpid()}-{k}"  # namespaces
        self.tag = f"mt{os.getpid():x}{k}"  # interfaces (<= 15 characters with suffixes)
        self.hosts: list[Host] = []
        self._subnet = _free_subnet()
        self.gateway = f"{self._subnet}.1"  # the bridge's address: this process, seen from hosts
        self._bridge = f"{self.tag}b"
        try:
            _ip("link", "add", self._bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self._bridge)
            _ip("link", "set", self._bridge, "up")
        except Exception:
            self.close()
            raise

    def add_host(self, name: str) -> Host:
        i = len(self.hosts)
        if i > 250:
            raise ValueError("a /24 holds at most 251 hosts")
        host = Host(name, f"{self.prefix}-{name}", f"{self._subnet}.{2 + i}")
        self.hosts.append(host)  # before creating anything: close() then removes what exists
        outside, inside = f"{self.tag}v{i}", f"{self.tag}p{i}"
        ns = host.namespace
        _ip("netns", "add", ns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", outside, "master", self._bridge)
        _ip("link", "set", outside, "up")
        _ip("link", "set", inside, "netns", ns)
        _ip("-n", ns, "link", "set", inside, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        return host

    def close(self) -> None:
        """Kill what still runs in our namespaces (only this Network's processes can be there),
        then remove veths, namespaces and the bridge. Never raises: it runs after failures."""
        for i, host in enumerate(self.hosts):
            _kill_all_in(host.namespace, 10.0)
            _ip("link", "del", f"{self.tag}v{i}", check=False)  # takes its inside end along
            _ip("netns", "del", host.namespace, check=False)
        _ip("link", "del", self._bridge, check=False)

    def __enter__(self) -> Network:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def leftovers(tag: str, prefix: str) -> list[str]:
    """Interfaces named `tag`* and namespaces named `prefix`* that still exist."""
    links = _ip("-o", "link", "show", check=False).stdout.splitlines()
    names = [line.split(":")[1].strip().split("@")[0] for line in links if ":" in line]
    found = [n for n in names if n.startswith(tag)]
    found += [
        line.split()[0]
        for line in _ip("netns", "list", check=False).stdout.splitlines()
        if line.split() and line.split()[0].startswith(prefix)
    ]
    return found


def _free_subnet() -> str:
    routes = _ip("-4", "route", "show", "table", "all", check=False).stdout
    taken = {
        ".".join(word.split("/")[0].split(".")[:3])
        for line in routes.splitlines()
        for word in line.split()
        if word.startswith(f"{_SUBNET_BASE}.")
    }
    start = os.getpid() % 250  # parallel runs start their search at different /24s
    for n in itertools.chain(range(start, 255), range(start)):
        if f"{_SUBNET_BASE}.{n}" not in taken:
            return f"{_SUBNET_BASE}.{n}"
    raise RuntimeError(f"every {_SUBNET_BASE}.N.0/24 is routed already")


def _kill_all_in(namespace: str, timeout_s: float) -> None:
    """SIGKILL every process in `namespace` and wait until none is left in it (a process
    leaves its namespaces when it exits, zombie or not, so no reaping is needed)."""
    deadline = time.monotonic() + timeout_s
    while pids := _ip("netns", "pids", namespace, check=False).stdout.split():
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        if time.monotonic() > deadline:
            return  # leftovers() will name the namespace
        time.sleep(0.05)
