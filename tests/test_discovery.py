"""Targets (host:port or dns:///NAME:PORT), lookups, and peer sets resolved lazily."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mili.discovery import (
    LEAVE_GRACE_S,
    Callers,
    LookupFailed,
    PeerSet,
    host_of,
    normal_address,
    parse_target,
    parse_targets,
    resolve_host,
)


def test_targets_parse_in_both_grpc_spellings() -> None:
    t = parse_target("dns:///Mili-Decode.mili.svc.cluster.local:50061")
    assert (t.spec, t.host, t.port, t.is_dns) == (
        "dns:///mili-decode.mili.svc.cluster.local:50061",
        "mili-decode.mili.svc.cluster.local",
        50061,
        True,
    )
    assert parse_target("dns:decode.test:7") == parse_target("dns:///decode.test:07")
    fixed = parse_target(" 10.0.0.3:50061 ")
    assert (fixed.spec, fixed.is_dns) == ("10.0.0.3:50061", False)
    assert parse_target("[::1]:5").spec == "[::1]:5"
    assert parse_target("dns:///[fd00::1]:5").address("fd00::2") == "[fd00::2]:5"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dns://8.8.8.8/decode.test:1", "DNS server of its own"),
        ("dns:///decode.test", "port"),
        ("decode.test:0", "port"),
        ("decode.test:http", "port"),
        ("dns://decode.test:1", "dns:///NAME:PORT"),
        (":5", "host:port"),
        ("[::1:5", "unclosed"),
    ],
)
def test_bad_targets_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_target(text)


def test_target_lists_are_comma_separated_and_never_repeat() -> None:
    assert [t.spec for t in parse_targets(["a:1, dns:///b:2", "c:3"])] == [
        "a:1",
        "dns:///b:2",
        "c:3",
    ]
    with pytest.raises(ValueError, match="repeated: a:1"):
        parse_targets(["a:1,A:01"])


def test_addresses_and_peers() -> None:
    assert normal_address("Host:0080") == "host:80"
    assert normal_address("host") is None
    assert host_of("ipv4:10.1.2.3:51234") == "10.1.2.3"
    assert host_of("ipv6:[::1]:51234") == "::1"
    assert host_of("ipv6:%5B::1%5D:51234") == "::1"  # as grpc writes it
    assert host_of("unix:/tmp/x") is None


def test_the_system_resolver_answers_literals_localhost_and_missing_names() -> None:
    async def main() -> None:
        assert await resolve_host("10.0.0.7") == ("10.0.0.7",)
        assert "127.0.0.1" in await resolve_host("localhost")
        assert await resolve_host("no-such-host.invalid") == ()

    asyncio.run(main())


class FakeDns:
    def __init__(self, records: dict[str, tuple[str, ...]]) -> None:
        self.records = records
        self.lookups: list[str] = []
        self.is_down = False

    async def __call__(self, host: str) -> tuple[str, ...]:
        self.lookups.append(host)
        if self.is_down:
            raise LookupFailed(f"{host}: resolver down")
        return self.records.get(host, ())


def test_peer_sets_look_up_again_when_old_or_on_a_miss_and_keep_answers_through_outages() -> None:
    dns = FakeDns({"decode.test": ("10.0.0.3",)})
    now = [0.0]
    peers = PeerSet.parse(
        ["dns:///decode.test:50061,127.0.0.1:7"],
        max_age_s=5.0,
        retry_s=0.5,
        resolve=dns,
        clock=lambda: now[0],
    )

    async def main() -> None:
        assert await peers.has_address("10.0.0.3:50061")
        assert await peers.has_address("127.0.0.1:7")
        assert dns.lookups == ["decode.test"]  # an IP is not looked up
        # A new instance: refused until a lookup shows it; a miss looks up at most every 0.5 s.
        dns.records["decode.test"] = ("10.0.0.3", "10.0.0.9")
        assert not await peers.has_address("10.0.0.9:50061")  # answer 0 s old: no lookup
        now[0] = 0.6
        assert await peers.has_address("10.0.0.9:50061")
        assert not await peers.has_address("10.0.0.9:1")  # right host, wrong port
        assert await peers.has_host("10.0.0.9") and await peers.has_host("127.0.0.1")
        assert peers.target_of("10.0.0.9:50061") == parse_target("dns:///decode.test:50061")
        # The resolver goes down: what it said last still holds.
        dns.is_down = True
        now[0] = 10.0
        assert await peers.has_address("10.0.0.9:50061")
        # It comes back without 10.0.0.3: gone from the answer once it is older than max_age_s,
        # then draining: still admitted for LEAVE_GRACE_S (found by an exploratory test: a
        # frontend that had not looked up yet routed requests to it, and prefill refused their
        # KV, PERMISSION_DENIED, while another decode was up).
        dns.is_down = False
        dns.records["decode.test"] = ("10.0.0.9",)
        assert await peers.has_address("10.0.0.3:50061")  # 0 s old: not looked up again
        now[0] = 15.1
        assert await peers.has_address("10.0.0.3:50061") and await peers.has_host("10.0.0.3")
        now[0] = 15.1 + LEAVE_GRACE_S - 1  # looked up again (old): still leaving
        assert await peers.has_address("10.0.0.3:50061") and await peers.has_host("10.0.0.3")
        now[0] = 15.1 + LEAVE_GRACE_S + 0.1
        assert not await peers.has_address("10.0.0.3:50061")
        assert not await peers.has_host("10.0.0.3")
        assert await peers.has_address("10.0.0.9:50061")
        # One that comes back while leaving is simply in the answer again.
        dns.records["decode.test"] = ("10.0.0.9", "10.0.0.3")
        now[0] += 5.1
        assert await peers.has_address("10.0.0.3:50061")

    asyncio.run(main())


def test_a_name_that_never_resolves_is_logged_once_and_again_when_that_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dns = FakeDns({})
    peers = PeerSet.parse(["dns:///typo.test:50061,10.0.0.1:7"], resolve=dns)

    async def main() -> None:
        for _ in range(3):  # three lookups, one line
            await peers.refresh()
        assert peers.problems.by_target == {
            parse_target("dns:///typo.test:50061"): "resolves to no address"
        }
        dns.is_down = True
        await peers.refresh()
        await peers.refresh()
        dns.is_down = False
        dns.records["typo.test"] = ("10.0.0.3",)
        await peers.refresh()
        await peers.refresh()
        assert peers.problems.by_target == {}
        assert await peers.has_address("10.0.0.3:50061")

    with caplog.at_level(logging.INFO, logger="mili.discovery"):
        asyncio.run(main())
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "peer dns:///typo.test:50061 resolves to no address"),
        (
            "WARNING",
            "peer dns:///typo.test:50061 lookup failed (keeping its last answer): "
            "typo.test: resolver down",
        ),
        ("INFO", "peer dns:///typo.test:50061 resolves again"),
    ]


def test_any_admits_everyone_and_stands_alone() -> None:
    async def main() -> None:
        peers = PeerSet.parse(["*"])
        assert await peers.has_address("203.0.113.9:1") and await peers.has_host("203.0.113.9")

    asyncio.run(main())
    with pytest.raises(ValueError, match="alone"):
        PeerSet.parse(["*,a:1"])


def test_callers_by_flag_else_certificate_holders_else_this_machine() -> None:
    dns = FakeDns({"frontend.test": ("10.0.0.5",)})
    named = Callers("--frontend", PeerSet.parse(["dns:///frontend.test:50051"], resolve=dns))
    local = Callers.from_flag("--frontend", [], host="10.0.0.7", is_mtls=False)
    wildcard = Callers.from_flag("--frontend", [], host="0.0.0.0", is_mtls=False)
    mtls = Callers.from_flag("--frontend", [], host="0.0.0.0", is_mtls=True)

    async def main() -> None:
        # Named: the hosts of the flag's targets, whatever the caller's port; not loopback.
        assert await named.admits("ipv4:10.0.0.5:40000")
        assert not await named.admits("ipv4:127.0.0.1:40000")
        assert not await named.admits("unix:/tmp/socket")
        # This machine: loopback, unix sockets, and the address the server listens on.
        for peer in (
            "ipv4:127.0.0.1:1",
            "ipv4:127.0.0.2:1",
            "ipv6:[::1]:1",
            "unix:/x",
            "ipv4:10.0.0.7:1",
        ):
            assert await local.admits(peer), peer
        assert not await local.admits("ipv4:10.0.0.8:1")
        assert not await wildcard.admits("ipv4:10.0.0.7:1")  # 0.0.0.0 names no address
        assert not await local.admits("not a peer")
        # mTLS without the flag: the handshake already checked the certificate.
        assert await mtls.admits("ipv4:203.0.113.9:1")

    asyncio.run(main())
    assert (str(local), str(named)) == ("this machine", "--frontend dns:///frontend.test:50051")
    assert local.is_this_machine and not mtls.is_this_machine
    flagged = Callers.from_flag("--frontend", ["10.0.0.5:1"], host="127.0.0.1", is_mtls=True)
    assert str(flagged) == "--frontend 10.0.0.5:1"  # the flag wins over the certificate
    with pytest.raises(ValueError, match="--prefill: 'nope' needs a port"):
        Callers.from_flag("--prefill", ["nope"], host="127.0.0.1", is_mtls=False)
