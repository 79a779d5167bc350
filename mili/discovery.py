"""Instances named by address or by DNS name: parsing, resolving, and sets of peers.

A target is what an operator writes in --prefill / --decode:

    host:port            one instance, as spelled (grpc resolves the host itself)
    dns:///NAME:PORT     every address NAME resolves to, each an instance on PORT: a
                         Kubernetes headless Service answers with one A record per ready pod
    dns:NAME:PORT        the same (gRPC's naming spec allows both spellings)

Names are resolved with the system resolver (getaddrinfo: /etc/resolv.conf, search domains,
/etc/hosts), as every other program in the pod or on the host resolves them; `dns://AUTHORITY/`
(a resolver of one's own) is refused rather than silently ignored.

A failed lookup is not an empty answer: `resolve` says which. A name that does not exist (or
has no addresses) means its instances are gone; a resolver that is down or slow means nothing,
and callers keep what they knew (draining every instance because DNS hiccuped would fail every
request). Either is logged when it starts and when it changes (`LookupProblems`), so a name that
never resolves (a typo) does not go unnoticed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

DNS_SCHEME = "dns:"
ANY = "*"  # a peer set that admits everyone (only where every peer is trusted)
NO_ADDRESS = "resolves to no address"  # the problem of a name that does not exist or has none
# How long a peer set still admits an address gone from its name's answer: past the frontends'
# next lookups (--resolve-interval, 5 s) and the KV lease of a request routed before them (30 s).
LEAVE_GRACE_S = 60.0

_LOG = logging.getLogger("mili.discovery")


@dataclass(frozen=True)
class Target:
    """One --prefill / --decode entry: a fixed address, or a DNS name to resolve."""

    spec: str  # as written (normalised: host lower-cased, port without leading zeros)
    host: str  # without brackets
    port: int
    is_dns: bool

    def __str__(self) -> str:
        return self.spec

    def address(self, host: str | None = None) -> str:
        """`host:port` (IPv6 bracketed) of this target's host, or of `host` resolved from it."""
        return format_address(self.host if host is None else host, self.port)


def format_address(host: str, port: int) -> str:
    """`host:port`, IPv6 hosts bracketed (`[::1]:50051`)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class LookupFailed(Exception):
    """The resolver did not answer (down, slow, refused): not the same as no addresses."""


def parse_target(text: str) -> Target:
    """`host:port`, `dns:///NAME:PORT` or `dns:NAME:PORT`; ValueError saying what is wrong."""
    raw = text.strip()
    is_dns = raw.lower().startswith(DNS_SCHEME)
    rest = raw[len(DNS_SCHEME) :] if is_dns else raw
    if is_dns and rest.startswith("//"):
        authority, slash, rest = rest[2:].partition("/")
        if not slash:
            raise ValueError(f"{text!r}: write dns:///NAME:PORT")
        if authority:
            raise ValueError(
                f"{text!r}: dns://{authority}/ names a DNS server of its own; only the system "
                "resolver is used (write dns:///NAME:PORT)"
            )
    host, port = _split_host_port(rest, text)
    spec = f"{DNS_SCHEME}///{format_address(host, port)}" if is_dns else format_address(host, port)
    return Target(spec=spec, host=host, port=port, is_dns=is_dns)


def parse_targets(values: Iterable[str]) -> tuple[Target, ...]:
    """Comma-separated lists (and repeated flags) of targets, blanks dropped, repeats refused."""
    targets = tuple(parse_target(t) for v in values for t in v.split(",") if t.strip())
    specs = [t.spec for t in targets]
    repeated = sorted({s for s in specs if specs.count(s) > 1})
    if repeated:
        raise ValueError(f"repeated: {', '.join(repeated)}")
    return targets


def normal_address(address: str) -> str | None:
    """`host:port` in one spelling (host lower-cased, port without leading zeros, IPv6
    bracketed), or None when `address` is not host:port with a port in 1..65535."""
    try:
        host, port = _split_host_port(address.strip(), address)
    except ValueError:
        return None
    return format_address(host, port)


def host_of(peer: str) -> str | None:
    """The IP of a grpc peer string (`ipv4:10.0.0.3:51234`, `ipv6:[::1]:51234`; grpc writes
    the latter percent-encoded, `ipv6:%5B::1%5D:51234`), else None (not an IP)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, _ = urllib.parse.unquote(rest).rpartition(":")
    host = host.strip("[]")
    return host if is_ip(host) else None


def _split_host_port(text: str, original: str) -> tuple[str, int]:
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        if not bracket:
            raise ValueError(f"{original!r}: unclosed '[' in the host")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            host, port = text, ""
    if not host or any(c.isspace() or c in "/@" for c in host):
        raise ValueError(f"{original!r} is not host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{original!r} needs a port in 1..65535 (host:port)")
    return host.lower(), int(port)


Resolve = Callable[[str], Awaitable[tuple[str, ...]]]


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve_host(host: str) -> tuple[str, ...]:
    """Every address `host` resolves to (sorted, IPv4 and IPv6), () when it does not exist or
    has none; LookupFailed when the resolver did not answer."""
    if is_ip(host):
        return (host,)
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return ()
        raise LookupFailed(f"{host}: {e.strerror or e}") from None
    return tuple(sorted({str(info[4][0]) for info in infos}))


class LookupProblems:
    """What went wrong with each target's last lookup, logged once per change: a WARNING when
    a name resolves to no address (never did, or stopped) or its lookup fails (or fails
    differently), an INFO line when it resolves again. Nothing is logged per lookup."""

    def __init__(self, log: logging.Logger = _LOG, who: str = "") -> None:
        self._log = log
        self._who = who  # ahead of the target in each line: "peer" (a PeerSet's), or ""
        self.by_target: dict[Target, str] = {}  # only targets whose last lookup went wrong

    def update(self, target: Target, problem: str | None) -> None:
        """Record `target`'s last lookup: None when it resolved to at least one address."""
        if self.by_target.get(target) == problem:
            return
        who = f"{self._who} " if self._who else ""
        if problem is None:
            del self.by_target[target]
            self._log.info("%s%s resolves again", who, target)
        else:
            self.by_target[target] = problem
            self._log.warning("%s%s %s", who, target, problem)


class PeerSet:
    """Which peers a service accepts (or may dial), from targets, resolved lazily.

    A fixed `host:port` target admits that address as spelled (and, for `has_host`, whatever its
    host resolves to); a DNS target admits every address its name resolves to. Answers are kept
    `max_age_s`; an address not in the set makes one fresh lookup (at most every `retry_s`)
    before it is refused, so an instance that just appeared in DNS is not refused for a whole
    `max_age_s`. A lookup that fails keeps the previous answer. An address (and host) gone from
    a name's answer stays in the set `leave_grace_s`: a pod leaving DNS is draining, and the
    requests frontends sent it before their own next lookup still hand their KV over (prefill
    refused them, PERMISSION_DENIED, while another decode was up).
    """

    def __init__(
        self,
        targets: Sequence[Target],
        *,
        is_any: bool = False,
        max_age_s: float = 5.0,
        retry_s: float = 0.5,
        leave_grace_s: float = LEAVE_GRACE_S,
        resolve: Resolve = resolve_host,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.targets = tuple(targets)
        self.is_any = is_any
        self._max_age_s = max_age_s
        self._retry_s = retry_s
        self._leave_grace_s = leave_grace_s
        # What left a DNS answer, and when: still in the set until leave_grace_s later.
        self._left_addresses: dict[str, tuple[Target, float]] = {}
        self._left_hosts: dict[str, float] = {}
        self._resolve = resolve
        self._clock = clock
        self._fixed = frozenset(t.spec for t in targets if not t.is_dns)
        self._addresses: dict[str, Target] = {t.spec: t for t in targets if not t.is_dns}
        self._hosts: set[str] = set()
        self._last: dict[Target, tuple[str, ...]] = {}  # each target's last answer
        self._resolved_at: float | None = None
        # Fixed targets' hosts are looked up only once `has_host` is asked (callers come from
        # IPs); `has_address` knows them as spelled.
        self._is_asked_hosts = False
        self._lock = asyncio.Lock()
        self.problems = LookupProblems(who="peer")

    @classmethod
    def parse(cls, values: Iterable[str], **kwargs: object) -> PeerSet:
        """From flag values: targets, or ANY alone."""
        texts = [t.strip() for v in values for t in v.split(",") if t.strip()]
        if ANY in texts:
            if len(texts) > 1:
                raise ValueError(f"'{ANY}' allows any peer: give it alone")
            return cls((), is_any=True, **kwargs)  # type: ignore[arg-type]
        return cls(parse_targets(texts), **kwargs)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return ANY if self.is_any else ", ".join(t.spec for t in self.targets)

    async def has_address(self, address: str) -> bool:
        """Whether `address` (host:port, as a frontend names an instance) is in the set. A
        fixed target's address is known as spelled: only DNS targets are looked up for it."""
        if self.is_any:
            return True
        normal = normal_address(address)
        if normal is None:
            return False
        if normal in self._fixed:
            return True
        if not any(t.is_dns for t in self.targets):
            return False
        return await self._check(
            lambda: (
                normal in self._addresses
                or self._is_leaving(self._left_addresses.get(normal, (None, None))[1])
            )
        )

    async def has_host(self, host: str) -> bool:
        """Whether `host` (a peer's IP; its port is ephemeral) is a host of the set."""
        if self.is_any:
            return True
        if not self._is_asked_hosts:  # the fixed targets' hosts were never looked up
            self._is_asked_hosts = True
            self._resolved_at = None
        host = host.lower()
        return await self._check(
            lambda: host in self._hosts or self._is_leaving(self._left_hosts.get(host))
        )

    def target_of(self, address: str) -> Target | None:
        """The target that `address` came from (its DNS name verifies a TLS peer), if known."""
        normal = normal_address(address)
        if normal is None:
            return None
        leaving = self._left_addresses.get(normal)
        return self._addresses.get(normal, leaving[0] if leaving else None)

    async def _check(self, is_in: Callable[[], bool]) -> bool:
        now = self._clock()
        age = None if self._resolved_at is None else now - self._resolved_at
        if age is None or age >= self._max_age_s or (not is_in() and age >= self._retry_s):
            await self.refresh()
        return is_in()

    async def refresh(self) -> None:
        """Look every name up again (one refresh at a time)."""
        async with self._lock:
            addresses = {t.spec: t for t in self.targets if not t.is_dns}
            hosts: set[str] = set()
            for target in self.targets:
                if not target.is_dns and not self._is_asked_hosts:
                    continue
                try:
                    ips = (target.host,) if is_ip(target.host) else await self._resolve(target.host)
                    self.problems.update(target, None if ips else NO_ADDRESS)
                except LookupFailed as e:
                    self.problems.update(target, f"lookup failed (keeping its last answer): {e}")
                    ips = self._last.get(target, ())  # keep what the last answer said
                self._last[target] = ips
                for ip in ips:
                    hosts.add(ip.lower())
                    if target.is_dns:
                        addresses[target.address(ip)] = target
            now = self._clock()
            self._keep_leaving(addresses, hosts, now)
            self._addresses, self._hosts = addresses, hosts
            self._resolved_at = now

    def _keep_leaving(self, addresses: dict[str, Target], hosts: set[str], now: float) -> None:
        """Note what the fresh answer (`addresses`, `hosts`) lost since the last, and forget
        what left more than leave_grace_s ago or came back."""
        for address, target in self._addresses.items():
            if address not in addresses:
                self._left_addresses.setdefault(address, (target, now))
        for host in self._hosts - hosts:
            self._left_hosts.setdefault(host, now)
        horizon = now - self._leave_grace_s
        self._left_addresses = {
            a: (t, at)
            for a, (t, at) in self._left_addresses.items()
            if at > horizon and a not in addresses
        }
        self._left_hosts = {
            h: at for h, at in self._left_hosts.items() if at > horizon and h not in hosts
        }

    def _is_leaving(self, left_at: float | None) -> bool:
        return left_at is not None and left_at > self._clock() - self._leave_grace_s


class Callers:
    """Who may call an internal RPC; mili.rpc's server checks it on every call to the methods a
    service guards, before the servicer runs (the one peer check of every service):

        named         the hosts of a flag's targets (`--frontend`, `--prefill`: host:port or
                      dns:///NAME:PORT; the port is not compared, a caller's is ephemeral); a
                      name is looked up again when an unknown caller comes (PeerSet)
        anyone        the flag's '*', or an mTLS port: its handshake already refused every
                      caller without a certificate the CA signed
        this machine  neither: loopback addresses, unix sockets, and the address the server
                      listens on (a process of this machine dialing that address sends from it)

    A plaintext port tells callers apart only by source address: whoever can send from a listed
    host (or spoof it on the network) passes. mTLS is the stronger check.
    """

    def __init__(
        self, flag: str, peers: PeerSet | None = None, *, local_hosts: Iterable[str] = ()
    ) -> None:
        self.flag = flag  # the flag that names them, for refusals: "--frontend"
        self.peers = peers  # None: this machine
        self._local_hosts = frozenset(
            h.strip("[]").lower() for h in local_hosts if _is_specific_ip(h)
        )

    @classmethod
    def from_flag(cls, flag: str, values: Iterable[str], *, host: str, is_mtls: bool) -> Callers:
        """From a flag's values (targets, or '*'); without any: anyone on an mTLS port, else
        this machine (with `host`, the address the server listens on). ValueError naming the
        flag when a value is not a target."""
        values = [v for v in values if v.strip()]
        if values:
            try:
                return cls(flag, PeerSet.parse(values))
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None
        if is_mtls:
            return cls(flag, PeerSet((), is_any=True))
        return cls(flag, local_hosts=(host,))

    @property
    def is_this_machine(self) -> bool:
        return self.peers is None

    def __str__(self) -> str:
        if self.peers is None:
            return "this machine"
        if self.peers.is_any:
            return f"any caller ({self.flag} {ANY}, or a certificate the CA signed)"
        return f"{self.flag} {self.peers}"

    async def admits(self, peer: str) -> bool:
        """Whether the caller (grpc's `context.peer()`: `ipv4:10.0.0.3:51234`, `unix:...`) is
        one of these."""
        peers = self.peers
        if peers is not None and peers.is_any:
            return True
        if peer.startswith("unix:"):
            return peers is None
        host = host_of(peer)
        if host is None:
            return False
        if peers is None:
            return ipaddress.ip_address(host).is_loopback or host.lower() in self._local_hosts
        return await peers.has_host(host)


def _is_specific_ip(host: str) -> bool:
    """An IP literal other than the wildcard (0.0.0.0, ::)."""
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False
