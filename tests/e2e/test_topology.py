"""A multi-host topology on one machine, found through a real DNS server for the test domain
that answers each headless name with one A record per instance, mTLS between all of them.
Every test runs twice, once per placement of the instances:

    loopback   each instance on its own loopback address (127.0.0.x) of this namespace
    netns      each instance in its own network namespace with its own IP on a bridge (veth
               pairs, tests/netns.py); skipped with the reason where namespaces cannot be made

    tokenizer  T                     prefill.mili.test -> P1, P2   (one port)
    frontend   (this process)        decode.mili.test  -> D1, D2   (+ D3 later)

Prefill, decode and the tokenizer are real processes (`python -m mili serve-*` with --host and
--tls-*; in netns each under `ip netns exec`); the frontend runs here with the DNS server as
its resolver (the one seam discovery leaves open: a process would use the system resolver) and
reaches the namespaces over the bridge.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest
import torch

from mili.demo.model import MAX_POSITION_EMBEDDINGS
from mili.engine.generate import generate
from mili.engine.model.loader import load_model, tokenizer_vocab_size
from mili.engine.sampling_params import SamplingParams
from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from mili.ports import pick_free
from mili.rpc.certs import Authority, CertFiles
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig, ServerTls
from mili.rpc.tls import Tls, TlsFiles
from mili.telemetry.metrics import FrontendMetrics
from services.frontend.backends import Backends
from services.frontend.config import FrontendConfig
from services.frontend.generations import Generations
from services.frontend.router import Router
from services.frontend.server import GenerationServicer, add_to_server
from tests import netns
from tests.dns_server import DnsServer
from tests.e2e.conftest import DECODE_ARGS, PREFILL_ARGS
from tests.service_process import ServiceProcess

PREFILL_NAME, DECODE_NAME = "prefill.mili.test", "decode.mili.test"
RESOLVE_INTERVAL_S = 0.5
_ROUTE = re.compile(r"done: prefill (\S+) -> decode (\S+),")


@dataclass(frozen=True)
class Placement:
    """Where each instance runs: its IP, and the command prefix that starts a process there."""

    name: str
    tokenizer_ip: str
    prefill_ips: tuple[str, ...]
    decode_ips: tuple[str, ...]
    spare_decode_ip: str  # started with the others, in DNS only when a test adds it
    prefill_port: int
    decode_port: int
    prefixes: dict[str, tuple[str, ...]]  # by IP; none: this namespace

    @property
    def ips(self) -> list[str]:
        return [self.tokenizer_ip, *self.prefill_ips, *self.decode_ips, self.spare_decode_ip]

    def prefix(self, ip: str) -> tuple[str, ...]:
        return self.prefixes.get(ip, ())


def _loopback() -> Placement:
    prefill_ips, decode_ips = ("127.0.0.11", "127.0.0.12"), ("127.0.0.21", "127.0.0.22")
    return Placement(
        "loopback",
        "127.0.0.1",
        prefill_ips,
        decode_ips,
        "127.0.0.23",
        pick_free(prefill_ips[0]),
        pick_free(decode_ips[0]),
        {},
    )


def _namespaces(net: netns.Network) -> Placement:
    hosts = [net.add_host(n) for n in ("tok", "pre0", "pre1", "dec0", "dec1", "dec2")]
    return Placement(
        "netns",
        hosts[0].ip,
        (hosts[1].ip, hosts[2].ip),
        (hosts[3].ip, hosts[4].ip),
        hosts[5].ip,
        50061,  # each namespace's ports are its own: nothing else listens there
        50071,
        {h.ip: tuple(h.command([])) for h in hosts},
    )


@pytest.fixture(scope="module", params=["loopback", "netns"])
def placement(request: pytest.FixtureRequest) -> Iterator[Placement]:
    if request.param == "loopback":
        yield _loopback()
        return
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces: {reason}")
    with netns.Network() as net:
        yield _namespaces(net)
    assert netns.leftovers(net.tag, net.prefix) == [], "namespaces or links left behind"


class _Routes(logging.Handler):
    """The frontend's per-request lines: which prefill and decode served each request."""

    def __init__(self) -> None:
        super().__init__()
        self.routes: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = _ROUTE.search(record.getMessage())
        if match:
            self.routes.append((match.group(1), match.group(2)))


class FrontendThread:
    """The frontend's RpcServer and Backends on an event loop of their own."""

    def __init__(self, config: FrontendConfig, tls: Tls, dns: DnsServer) -> None:
        self._loop = asyncio.new_event_loop()
        self._config, self._tls, self._dns = config, tls, dns
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),))
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("frontend did not start")

    async def _main(self) -> None:
        self._closing = asyncio.Event()
        server_tls = ServerTls(self._tls, require_client_auth=True)
        self.server = RpcServer(
            ServerConfig(tls=server_tls, drain_timeout_s=2.0, grace_s=0.5), name="frontend"
        )
        metrics = FrontendMetrics(self.server.registry)
        self.backends = Backends(
            self._config, Router(), tls=self._tls, metrics=metrics, resolve=self._dns.resolve
        )
        add_to_server(self.server, GenerationServicer(Generations(self.backends, metrics)))
        await self.backends.start()
        await self.server.start()
        self._ready.set()
        await self._closing.wait()
        await self.server.drain()
        await self.backends.close()

    @property
    def address(self) -> str:
        return f"localhost:{self.server.port}"

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._closing.set)
        self._thread.join(30)
        self._loop.close()


@dataclass
class Topology:
    placement: Placement
    pki: dict[str, CertFiles]
    dns: DnsServer
    tokenizer: ServiceProcess
    prefills: dict[str, ServiceProcess]  # by address
    decodes: dict[str, ServiceProcess]
    frontend: FrontendThread
    routes: _Routes

    @property
    def decode_port(self) -> int:
        return self.placement.decode_port

    def client_credentials(self) -> grpc.ChannelCredentials:
        client = self.pki["client"]
        return grpc.ssl_channel_credentials(
            root_certificates=client.ca.read_bytes(),
            private_key=client.key.read_bytes(),
            certificate_chain=client.cert.read_bytes(),
        )

    def stub(self) -> generation_pb2_grpc.GenerationServiceStub:
        channel = grpc.secure_channel(self.frontend.address, self.client_credentials())
        return generation_pb2_grpc.GenerationServiceStub(channel)

    def kv_transports(self, prefill_address: str) -> dict[str, str]:
        """Decode address -> the KV transport prefill paired with it (prefill's Info)."""
        with grpc.secure_channel(prefill_address, self.client_credentials()) as channel:
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            return dict(stub.Info(prefill_pb2.InfoRequest(), timeout=10).kv_transports)

    def decode_view(self, address: str) -> Any:
        return self.frontend.backends.router.decodes.get(address)


def _tls_args(files: CertFiles) -> tuple[str, ...]:
    return ("--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca))


@pytest.fixture(scope="module")
def topology(
    placement: Placement, demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Topology]:
    p = placement
    ca = Authority()
    root = tmp_path_factory.mktemp(f"topology-pki-{p.name}")
    # Prefill's --decode '*' (its system resolver cannot see the test domain) dials decode by
    # IP and verifies it as that IP: the certificate carries the IPs too, as per-pod
    # certificates do. With dns:/// entries (the manifests) the name is verified instead.
    names = ["localhost", PREFILL_NAME, DECODE_NAME, *p.ips]
    pki = {
        "services": ca.write(root, "services", names),
        "frontend": ca.write(root, "frontend", ["localhost", "frontend.mili.test"]),
        "client": ca.write(root, "client", ["client"]),
    }
    dns = DnsServer({PREFILL_NAME: list(p.prefill_ips), DECODE_NAME: list(p.decode_ips)})
    dns.start()
    # torch attention: six processes compiling kernels at once on two cores would outlast the
    # start-up timeout; the kernels are not what this test is about.
    model = ("--model", str(demo_model_dir), "--dtype", "float32", "--attention", "torch")
    tls = _tls_args(pki["services"])
    tokenizer = ("serve-tokenizer", *model[:2], "--host", p.tokenizer_ip, "--port", "0", *tls)
    specs: list[tuple[tuple[str, ...], tuple[str, ...]]] = [(p.prefix(p.tokenizer_ip), tokenizer)]
    # KV goes to any decode the frontend names: the mTLS handshake is the check here (every
    # peer holds a certificate our CA signed), as the manifests do.
    prefill = (*PREFILL_ARGS, "--decode", "*", *tls)
    specs += [
        (
            p.prefix(ip),
            ("serve-prefill", *model, "--host", ip, "--port", str(p.prefill_port), *prefill),
        )
        for ip in p.prefill_ips
    ]
    decode = ("--port", str(p.decode_port), *DECODE_ARGS, *tls)
    specs += [
        (p.prefix(ip), ("serve-decode", *model, "--host", ip, *decode))
        for ip in [*p.decode_ips, p.spare_decode_ip]
    ]
    services = _start_all(specs)
    tokenizer, prefills, decodes = services[0], services[1:3], services[3:]
    config = FrontendConfig(
        tokenizer_address=tokenizer.address,
        prefill_addresses=(f"dns:///{PREFILL_NAME}:{p.prefill_port}",),
        decode_addresses=(f"dns:///{DECODE_NAME}:{p.decode_port}",),
        poll_interval_s=0.2,
        resolve_interval_s=RESOLVE_INTERVAL_S,
    )
    routes = _Routes()
    logging.getLogger("mili.frontend").addHandler(routes)
    logging.getLogger("mili.frontend").setLevel(logging.INFO)
    frontend = FrontendThread(config, TlsFiles(*_files(pki["frontend"])).load(), dns)
    t = Topology(
        p,
        pki,
        dns,
        tokenizer,
        {p.address: p for p in prefills},
        {d.address: d for d in decodes},
        frontend,
        routes,
    )
    try:
        _wait(lambda: frontend.backends.problem is None, 30)
        yield t
    finally:
        logging.getLogger("mili.frontend").removeHandler(routes)
        frontend.close()
        for service in services:
            if service.proc.poll() is None:
                service.terminate(timeout_s=30)
        dns.stop()


def _start_all(specs: list[tuple[tuple[str, ...], tuple[str, ...]]]) -> list[ServiceProcess]:
    """start_all's all-or-none start of (prefix, args) pairs, with a start-up limit for six
    processes loading torch at once on a shared two-core machine."""
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        futures = [
            pool.submit(lambda s=spec: ServiceProcess(*s[1], timeout_s=300, prefix=s[0]))
            for spec in specs
        ]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures:
            if f.exception() is None:
                f.result().proc.kill()
        raise errors[0]  # type: ignore[misc]
    return [f.result() for f in futures]


def _files(files: CertFiles) -> tuple[Path, Path, Path]:
    return files.cert, files.key, files.ca


def _wait(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout_s} s")
        time.sleep(0.05)


class _Try(NamedTuple):
    """A streaming call read on a pool thread."""

    responses: Future[list[Any] | grpc.RpcError]  # all of them, or the error it ended with
    is_streaming: threading.Event  # set at its first response


def _read(call: Any, is_streaming: threading.Event) -> list[Any] | grpc.RpcError:
    responses: list[Any] = []
    try:
        for response in call:
            responses.append(response)
            is_streaming.set()
    except grpc.RpcError as e:
        return e
    return responses


def _in_flight(decodes: dict[str, Any]) -> dict[str, int]:
    """The frontend's requests in flight on each decode (its router's views)."""
    return {address: view.num_in_flight for address, view in list(decodes.items())}


def _routed_since(decodes: dict[str, Any], before: dict[str, int]) -> set[str]:
    """The decodes the frontend routed a request to since `_in_flight` gave `before`."""
    return {address for address, n in _in_flight(decodes).items() if n > before.get(address, 0)}


def _one_routed_to(
    topology: Topology,
    view: Any,
    open_call: Callable[[int], Any],
    pool: ThreadPoolExecutor,
    seed: int,
    bias: int = -100_000,
) -> _Try:
    """The call `open_call(seed)` opens, read on `pool`, once the frontend routed it to the
    decode `view` shows. The view is made the best choice for the next request (`bias` blocks
    of room more: lower than another view's to win over that one too); an Info poll (every
    0.2 s) landing before the request is routed resets that and it goes elsewhere: then that
    try is cancelled (a long one held its pool thread for minutes, and its 10 s wait ran out:
    seen under load) and another sent (up to 20 times), with a new prompt (the same one
    would follow its cached prefix to where it went)."""
    decodes = topology.frontend.backends.router.decodes
    for attempt in range(20):
        before = _in_flight(decodes)
        view.num_blocks_since_poll = bias
        call = open_call(seed + attempt)
        is_streaming = threading.Event()
        held = pool.submit(_read, call, is_streaming)
        _wait(lambda h=held, b=before: bool(_routed_since(decodes, b)) or h.done(), 10)
        if view.address in _routed_since(decodes, before):
            return _Try(held, is_streaming)
        call.cancel()
        held.result(timeout=120)
    raise AssertionError(f"no request was routed to {view}")


def _generate(stub: Any, n: int, max_tokens: int, seed: int) -> list[Any]:
    return list(_open(stub, n, max_tokens, seed))


def _open(stub: Any, n: int, max_tokens: int, seed: int) -> Any:
    return stub.Generate(_request(n, max_tokens, seed=seed), timeout=120)


def _request(n: int, max_tokens: int, seed: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=[(seed * 31 + 7 * i) % 800 + 3 for i in range(n)],
        sampling=sampling_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ),
    )


def _token_ids(responses: list[generation_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_greedy_tokens_equal_generate_across_every_instance(
    topology: Topology, demo_model_dir: Path
) -> None:
    model = load_model(demo_model_dir, dtype=torch.float32)
    requests = [_request(9 + 4 * i, 8, seed=i) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    vocab_size = tokenizer_vocab_size(demo_model_dir)  # the services sample only these ids
    expected = [
        generate(model, [list(r.token_ids)], params, vocab_size=vocab_size)[0].token_ids
        for r in requests
    ]
    stub = topology.stub()
    before = len(topology.routes.routes)
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda r: list(stub.Generate(r, timeout=60)), requests))
    assert [_token_ids(r) for r in results] == expected
    routes = topology.routes.routes[before:]
    placement = topology.placement
    assert {p for p, _ in routes} == {
        f"{ip}:{placement.prefill_port}" for ip in placement.prefill_ips
    }
    assert {d for _, d in routes} == {
        f"{ip}:{placement.decode_port}" for ip in placement.decode_ips
    }
    # Same host (loopback): KV bytes through decode's pool in shared memory. Each instance in a
    # namespace of its own does not share a host id (`ip netns exec` gives it its own mount
    # namespace): the pairs fall back to grpc, and the tokens above are equal all the same.
    transports = {t for a in topology.prefills for t in topology.kv_transports(a).values()}
    assert transports == ({"grpc"} if placement.name == "netns" else {"shm"})


def test_a_decode_added_to_dns_gets_work_within_the_interval(topology: Topology) -> None:
    placement = topology.placement
    spare = f"{placement.spare_decode_ip}:{topology.decode_port}"
    added_at = time.monotonic()
    topology.dns.records[DECODE_NAME] = [*placement.decode_ips, placement.spare_decode_ip]
    _wait(lambda: (v := topology.decode_view(spare)) is not None and v.is_routable, 5)
    assert time.monotonic() - added_at < 2 * RESOLVE_INTERVAL_S + 1.0
    stub = topology.stub()
    before = len(topology.routes.routes)
    for i in range(3):  # the newcomer has the most free blocks: it is chosen at once
        list(stub.Generate(_request(12, 4, seed=50 + i), timeout=60))
    assert spare in {d for _, d in topology.routes.routes[before:]}


def test_a_decode_removed_from_dns_drains_without_failing_its_request(
    topology: Topology,
) -> None:
    leaving_ip = topology.placement.decode_ips[0]
    leaving = f"{leaving_ip}:{topology.decode_port}"
    view = topology.decode_view(leaving)
    stub = topology.stub()
    with ThreadPoolExecutor(max_workers=1) as pool:
        held = _one_routed_to(
            topology, view, lambda seed: _open(stub, 16, 120, seed), pool, seed=77
        )
        topology.dns.records[DECODE_NAME] = [
            ip for ip in topology.dns.records[DECODE_NAME] if ip != leaving_ip
        ]
        _wait(lambda: view.is_draining, 5)
        responses = held.responses.result(timeout=120)
    assert not isinstance(responses, grpc.RpcError), responses
    assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert len(_token_ids(responses)) == 120
    _wait(lambda: topology.decode_view(leaving) is None, 5)  # dropped once drained


def test_a_decode_killed_mid_stream_fails_only_its_own_request(topology: Topology) -> None:
    spare_ip = topology.placement.spare_decode_ip
    victim_address = f"{spare_ip}:{topology.decode_port}"
    victim = topology.decodes[victim_address]
    survivor = f"{topology.placement.decode_ips[1]}:{topology.decode_port}"
    records = topology.dns.records[DECODE_NAME]
    if spare_ip not in records:  # run without the test that adds it
        topology.dns.records[DECODE_NAME] = [*records, spare_ip]
    _wait(lambda: (v := topology.decode_view(victim_address)) is not None and v.is_routable, 10)
    stub = topology.stub()
    # still streaming when the kill lands, however long routing the second one takes
    whole_context = MAX_POSITION_EMBEDDINGS - 16

    with ThreadPoolExecutor(max_workers=2) as pool:
        first = _one_routed_to(
            topology,
            topology.decode_view(victim_address),
            lambda seed: _open(stub, 16, whole_context, seed),
            pool,
            seed=91,
        )
        # over the victim's room too, should no poll have reset it yet
        second = _one_routed_to(
            topology,
            topology.decode_view(survivor),
            lambda seed: _open(stub, 16, 200, seed),
            pool,
            191,
            bias=-200_000,
        )
        assert first.is_streaming.wait(60) and second.is_streaming.wait(60)
        victim.proc.kill()
        error = first.responses.result(timeout=60)
        survived = second.responses.result(timeout=120)
    assert isinstance(error, grpc.RpcError), error
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert victim_address in (error.details() or ""), error.details()
    assert not isinstance(survived, grpc.RpcError), survived
    assert survived[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH


def test_each_instance_runs_where_its_placement_puts_it(topology: Topology) -> None:
    """netns: every service in a network namespace of its own, not ours; loopback: all in ours
    (so the other tests really cross namespaces in one placement and not in the other)."""
    services = [topology.tokenizer, *topology.prefills.values(), *topology.decodes.values()]
    alive = [s for s in services if s.proc.poll() is None]  # a test may have killed one
    spaces = [os.readlink(f"/proc/{s.proc.pid}/ns/net") for s in alive]
    ours = os.readlink("/proc/self/ns/net")
    if topology.placement.name == "netns":
        assert ours not in spaces and len(set(spaces)) == len(alive), spaces
    else:
        assert set(spaces) == {ours}
