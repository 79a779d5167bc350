"""A DNS server for a test domain (dnslib, in this process, UDP on 127.0.0.1) answering a
headless Service's name with one A record per instance, and a `Resolve` that asks it.

    server = DnsServer({"decode.mili.test": ["127.0.0.21", "127.0.0.22"]}); server.start()
    Backends(..., resolve=server.resolve)        # what getaddrinfo would do against it
    server.records["decode.mili.test"] = [...]   # a pod became ready / went away
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

# dnslib is a dev dependency the GPU host does not install: there the tests that import this
# module skip, instead of an ImportError stopping a whole-tree run at collection.
pytest.importorskip("dnslib")

from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from mili.discovery import LookupFailed
from mili.ports import pick_free


class _Resolver(BaseResolver):  # type: ignore[misc]
    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = records
        self.num_queries = 0

    def resolve(self, request: Any, handler: Any) -> Any:
        self.num_queries += 1
        reply = request.reply()
        name = str(request.q.qname).rstrip(".").lower()
        ips = self.records.get(name)
        if ips is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype in (QTYPE.A, QTYPE.ANY):
            for ip in ips:  # TTL 1: as short as kube-dns makes headless answers
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=1))
        return reply


class DnsServer:
    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = records
        self._resolver = _Resolver(records)
        self.port = pick_free("127.0.0.1")
        self._server = DNSServer(
            self._resolver,
            address="127.0.0.1",
            port=self.port,
            logger=DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data"),
        )

    @property
    def num_queries(self) -> int:
        return self._resolver.num_queries

    def start(self) -> None:
        self._server.start_thread()

    def stop(self) -> None:
        self._server.stop()

    async def resolve(self, host: str) -> tuple[str, ...]:
        """mili.discovery.Resolve against this server: () for NXDOMAIN, LookupFailed when it
        does not answer."""
        return await asyncio.to_thread(self._query, host)

    def _query(self, host: str) -> tuple[str, ...]:
        try:
            packet = DNSRecord.question(host, "A").send("127.0.0.1", self.port, timeout=1.0)
        except OSError as e:  # socket.timeout included
            raise LookupFailed(f"{host}: {e}") from None
        reply = DNSRecord.parse(packet)
        if reply.header.rcode == RCODE.NXDOMAIN:
            return ()
        return tuple(sorted(str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A))
