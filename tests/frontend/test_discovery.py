"""Decode instances found by DNS name, against the fakes (fakes.py) on real gRPC servers: each
fake decode listens on its own loopback IP (127.0.0.2, .3, .4) on one shared port, as pods
behind a headless Service do, and a scripted resolver stands in for DNS.

A new instance gets work once a lookup shows it; a vanished one finishes the request it holds
and is dropped; a resolver outage changes nothing; Info and metrics say who is a member."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from mili.discovery import LookupFailed
from mili.pb.common.v1 import sampling_pb2
from mili.pb.decode.v1 import decode_pb2_grpc
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from mili.pb.prefill.v1 import prefill_pb2_grpc
from mili.pb.tokenizer.v1 import tokenizer_pb2_grpc
from mili.ports import pick_free
from mili.rpc.client import insecure_channel
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig
from mili.telemetry.metrics import FrontendMetrics
from services.frontend.backends import Backends
from services.frontend.config import FrontendConfig
from services.frontend.generations import Generations
from services.frontend.instances import Instances
from services.frontend.router import Route, Router
from services.frontend.server import GenerationServicer, add_to_server
from services.frontend.validation import Limits
from tests.frontend.fakes import FakeDecode, FakePrefill, FakeTokenizer, collect, wait_until

NAME = "decode.mili.test"
IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
REQUEST = generation_pb2.GenerateRequest(
    prompt="hi", sampling=sampling_pb2.SamplingParams(max_tokens=8)
)


class ScriptedDns:
    def __init__(self, records: dict[str, tuple[str, ...]]) -> None:
        self.records = records
        self.is_down = False

    async def __call__(self, host: str) -> tuple[str, ...]:
        if self.is_down:
            raise LookupFailed(f"{host}: timed out")
        return self.records.get(host, ())


class HeldDecode(FakeDecode):
    """Streams its first token, then waits for `release` before the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.num_streaming = 0

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        i = 0
        async for reply in super().Generate(request, context):
            yield reply
            i += 1
            if i == 2:  # Admitted, then the first tokens
                self.num_streaming += 1
                await self.release.wait()


@dataclass
class Cluster:
    stub: generation_pb2_grpc.GenerationServiceStub
    decodes: dict[str, HeldDecode]  # by address
    dns: ScriptedDns
    backends: Backends
    registry: CollectorRegistry

    async def info(self) -> generation_pb2.InfoResponse:
        return await self.stub.Info(generation_pb2.InfoRequest(), timeout=5)

    async def decode_states(self) -> dict[str, str]:
        info = await self.info()
        return {
            i.address: generation_pb2.InstanceState.Name(i.state).removeprefix("INSTANCE_STATE_")
            for i in info.instances
            if i.kind == generation_pb2.INSTANCE_KIND_DECODE
        }


async def _serve(name: str, service: str, register: Any, host: str, port: int) -> RpcServer:
    server = RpcServer(
        ServerConfig(host=host, port=port, drain_timeout_s=0.5, grace_s=0.1), name=name
    )
    server.add_service(service, register)
    await server.start()
    return server


@contextlib.asynccontextmanager
async def cluster(*, more_decode_targets: tuple[str, ...] = ()) -> AsyncIterator[Cluster]:
    port = pick_free("127.0.0.2")
    prefill = FakePrefill()
    decodes = {f"{ip}:{port}": HeldDecode() for ip in IPS}
    servers = [
        await _serve(
            "tokenizer",
            "mili.tokenizer.v1.TokenizerService",
            lambda s: tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(FakeTokenizer(), s),
            "127.0.0.1",
            0,
        ),
        await _serve(
            "prefill",
            "mili.prefill.v1.PrefillService",
            lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(prefill, s),
            "127.0.0.1",
            0,
        ),
    ]
    for address, decode in decodes.items():
        prefill.decodes[address] = decode
        servers.append(
            await _serve(
                "decode",
                "mili.decode.v1.DecodeService",
                lambda s, d=decode: decode_pb2_grpc.add_DecodeServiceServicer_to_server(d, s),
                address.partition(":")[0],
                port,
            )
        )
    dns = ScriptedDns({NAME: IPS[:2]})
    config = FrontendConfig(
        tokenizer_address=servers[0].address,
        prefill_addresses=(servers[1].address,),
        decode_addresses=(f"dns:///{NAME}:{port}", *more_decode_targets),
        limits=Limits(default_max_tokens=16),
        poll_interval_s=0.05,
        resolve_interval_s=0.1,
        info_timeout_s=0.5,
    )
    frontend = RpcServer(ServerConfig(drain_timeout_s=0.5, grace_s=0.1), name="frontend")
    metrics = FrontendMetrics(frontend.registry)
    backends = Backends(config, Router(), resolve=dns, metrics=metrics)
    metrics.watch_instances(lambda: [(m.kind, m.state.value) for m in backends.router.members()])
    add_to_server(frontend, GenerationServicer(Generations(backends, metrics)))
    await backends.start()
    await frontend.start()
    channel = insecure_channel(frontend.address)
    try:
        yield Cluster(
            generation_pb2_grpc.GenerationServiceStub(channel),
            decodes,
            dns,
            backends,
            frontend.registry,
        )
    finally:
        for decode in decodes.values():
            decode.release.set()
        await channel.close()
        await frontend.drain()
        await backends.close()
        for server in servers:
            with contextlib.suppress(Exception):
                await server.drain()


def _instances(registry: CollectorRegistry, state: str) -> float | None:
    return registry.get_sample_value("mili_frontend_instances", {"kind": "decode", "state": state})


def test_instances_join_when_dns_shows_them_and_drain_when_it_stops() -> None:
    async def main() -> None:
        async with cluster() as c:
            first, second, third = c.decodes
            assert await c.decode_states() == {first: "UP", second: "UP"}
            info = await c.info()
            assert list(info.decode_targets) == [f"dns:///{NAME}:{first.rpartition(':')[2]}"]
            assert list(info.decode_addresses) == [first, second]
            assert {i.target for i in info.instances if i.address == first} == {
                info.decode_targets[0]
            }
            assert _instances(c.registry, "up") == 2

            # A third pod becomes ready: it is in Info, and gets work, within the interval.
            c.dns.records[NAME] = IPS
            await wait_until(lambda: c.backends.router.decodes.get(third) is not None, 1.0)
            await wait_until(lambda: c.backends.router.decodes[third].is_routable, 1.0)
            assert (await c.decode_states())[third] == "UP"
            for decode in c.decodes.values():
                decode.release.set()
            for _ in range(3):  # equal load: one request each, the newcomer included
                await collect(c.stub.Generate(REQUEST, timeout=5))
            assert all(len(d.requests) >= 1 for d in c.decodes.values()), {
                a: len(d.requests) for a, d in c.decodes.items()
            }

            # A request holds `first`; then `first` leaves DNS: it drains, the request ends OK.
            for decode in c.decodes.values():
                decode.release.clear()
            c.backends.router.decodes[first].num_free_blocks = 10_000  # the best choice
            c.backends.router.decodes[first].num_blocks_since_poll = -10_000
            held = asyncio.ensure_future(collect(c.stub.Generate(REQUEST, timeout=10)))
            await wait_until(lambda: c.decodes[first].num_streaming == 2, 2.0)
            c.dns.records[NAME] = IPS[1:]
            await wait_until(lambda: c.backends.router.decodes[first].is_draining, 1.0)
            assert (await c.decode_states())[first] == "DRAINING"
            assert _instances(c.registry, "draining") == 1
            before = len(c.decodes[first].requests)
            c.decodes[second].release.set()
            c.decodes[third].release.set()
            for _ in range(4):  # none of the new ones goes to the draining instance
                await collect(c.stub.Generate(REQUEST, timeout=5))
            assert len(c.decodes[first].requests) == before
            c.decodes[first].release.set()
            replies = await held
            assert replies[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            await wait_until(lambda: first not in c.backends.router.decodes, 1.0)
            assert await c.decode_states() == {second: "UP", third: "UP"}
            changes = "mili_frontend_instance_changes_total"
            dropped = {"kind": "decode", "change": "dropped"}
            # Its channel is closed at the next poll.
            await wait_until(lambda: c.registry.get_sample_value(changes, dropped) == 1, 1.0)
            for change, n in (("added", 3), ("draining", 1), ("dropped", 1)):
                labels = {"kind": "decode", "change": change}
                assert c.registry.get_sample_value(changes, labels) == n, change

    asyncio.run(main())


def test_an_instance_back_in_dns_before_its_drop_is_collected_is_polled_again() -> None:
    """A decode leaves DNS with a request on it (draining), the request ends (the router drops
    it; its stub is closed at the next poll), and the next lookup lists it again before that
    poll: it must come back with a stub of its own (before, the late collection closed the new
    stub and the instance stayed DOWN, never polled, until it left DNS again)."""

    async def main() -> None:
        dns = ScriptedDns({NAME: IPS[:1]})
        router = Router()
        config = FrontendConfig(
            tokenizer_address="127.0.0.1:1",
            prefill_addresses=("127.0.0.1:2",),
            decode_addresses=(f"dns:///{NAME}:7000",),
        )

        async def on_changes(changes: object) -> None:
            pass

        instances = Instances(
            config, router, on_changes=on_changes, on_dropped=lambda _: None, resolve=dns
        )
        await instances.start()
        try:
            decode, prefill = f"{IPS[0]}:7000", "127.0.0.1:2"
            router.update_prefill(prefill, num_queued_tokens=0, max_prompt_tokens=100)
            router.update_decode(
                decode, num_free_blocks=10, num_total_blocks=10, max_context_tokens=100
            )
            router.set_pair_error(prefill, decode, None)
            ticket = router.start(Route(prefill, decode), 5, 1)
            dns.records[NAME] = ()
            await instances.discover()
            assert router.decodes[decode].is_draining
            router.finish(ticket)  # dropped by the router; the stub waits for collection
            dns.records[NAME] = IPS[:1]
            await instances.discover()  # back before the next poll collected it
            instances.collect_drained()  # what the next poll does first
            assert instances.addresses("decode") == [decode]
            assert decode in router.decodes
        finally:
            await instances.close()

    asyncio.run(main())


def test_a_resolver_outage_keeps_the_members_and_an_empty_answer_drops_them() -> None:
    async def main() -> None:
        async with cluster() as c:
            first, second, _ = c.decodes
            for decode in c.decodes.values():
                decode.release.set()
            c.dns.is_down = True
            await asyncio.sleep(0.35)  # three lookups fail
            assert await c.decode_states() == {first: "UP", second: "UP"}
            await collect(c.stub.Generate(REQUEST, timeout=5))
            c.dns.is_down = False
            c.dns.records[NAME] = ()  # the Service has no ready pod left
            await wait_until(lambda: not c.backends.router.decodes, 1.0)
            info = await c.info()
            assert list(info.decode_addresses) == []
            assert c.backends.problem is not None and "none known" in c.backends.problem

    asyncio.run(main())


def test_a_name_that_never_resolves_is_logged_once_and_shown_in_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    typo = "dns:///decode.typo.test:50061"

    def problems(info: generation_pb2.InfoResponse) -> list[tuple[str, str]]:
        return [(p.target, p.problem) for p in info.target_problems]

    def lines() -> list[tuple[str, str]]:
        return [(r.levelname, r.getMessage()) for r in caplog.records if typo in r.getMessage()]

    async def main() -> None:
        async with cluster(more_decode_targets=(typo,)) as c:
            for decode in c.decodes.values():
                decode.release.set()
            await asyncio.sleep(0.35)  # three lookups more
            info = await c.info()
            assert problems(info) == [(typo, "resolves to no address")]
            assert typo in info.decode_targets
            await collect(c.stub.Generate(REQUEST, timeout=5))  # the other name serves
            assert lines() == [("WARNING", f"{typo} resolves to no address")]
            c.dns.is_down = True
            await asyncio.sleep(0.35)
            failed = "lookup failed (keeping its last answer): {}: timed out"
            named = c.backends.instances.targets("decode")[0].spec
            assert sorted(problems(await c.info())) == [
                (named, failed.format(NAME)),  # its instances stay
                (typo, failed.format("decode.typo.test")),
            ]
            assert await c.decode_states() == dict.fromkeys(list(c.decodes)[:2], "UP")
            c.dns.is_down = False
            c.dns.records["decode.typo.test"] = (IPS[2],)
            await asyncio.sleep(0.35)
            assert problems(await c.info()) == []
            assert lines() == [
                ("WARNING", f"{typo} resolves to no address"),
                ("WARNING", f"{typo} {failed.format('decode.typo.test')}"),
                ("INFO", f"{typo} resolves again"),
            ]

    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        asyncio.run(main())
