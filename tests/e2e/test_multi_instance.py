"""Two prefill and two decode instances behind one frontend: work spreads over all of them, and
a decode instance killed mid-request fails only its own request, fast, leaking no block."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from mili.kv_handoff.shm_segment import segments_of
from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from tests.e2e.conftest import Deployment, deploy
from tests.service_process import ServiceProcess

_ROUTE = re.compile(r"done: prefill (\S+) -> decode (\S+),")


@pytest.fixture(scope="module")
def deployment(demo_model_dir: Path, e2e_tokenizer: ServiceProcess) -> Iterator[Deployment]:
    d = deploy(demo_model_dir, e2e_tokenizer, num_prefills=2, num_decodes=2)
    yield d
    d.stop()


def request(n: int, max_tokens: int, seed: int = 0) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=[(seed * 31 + 7 * i) % 800 for i in range(n)],
        sampling=sampling_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ),
    )


def test_every_request_completes_and_every_instance_gets_work(deployment: Deployment) -> None:
    start = deployment.settled_free_blocks()

    def run(i: int) -> list[generation_pb2.GenerateResponse]:
        return list(deployment.stub().Generate(request(10 + 5 * i, 8, seed=i), timeout=60))

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(run, range(8)))
    for responses in results:
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == 8
    # The frontend logs each finished request's route: the tokens of each came from that
    # decode instance's stream, the KV from that prefill instance.
    lines = deployment.frontend.lines_matching(_ROUTE, 8)
    routes = [m.groups() for m in map(_ROUTE.search, lines) if m]
    assert len(routes) == 8
    assert {p for p, _ in routes} == {p.address for p in deployment.prefills}
    assert {d for _, d in routes} == {d.address for d in deployment.decodes}
    deployment.wait_free_blocks(start)


_CACHED = re.compile(r"prefix cached: (\d+) tokens? on prefill, (\d+) blocks? on decode")


def test_a_conversation_stays_on_the_instances_holding_its_prefix(
    deployment: Deployment,
) -> None:
    """Three conversations of three turns, interleaved; each turn resends the history. Every
    turn of a conversation goes where its first turn went (that instance holds its prefix; by
    load alone, sequential requests alternate and the second turns would swap instances), and
    later turns reuse cached blocks on both. (Spreading by load: the test above and the router's
    own tests.)"""
    start = deployment.settled_free_blocks()
    block_size = deployment.decode_info().kv_layout.block_size
    stub = deployment.stub()
    history: list[list[int]] = [[] for _ in range(3)]
    num_lines = len(deployment.frontend.stderr_lines)
    for turn in range(3):
        for c in range(3):
            new = [(97 * c + 13 * turn + 5 * i) % 800 + 1 for i in range(block_size + 3)]
            prompt = history[c] + new
            responses = list(stub.Generate(request_for(prompt, 6), timeout=60))
            assert responses[-1].usage.completion_tokens == 6
            history[c] = prompt + [t for r in responses for t in r.token_ids]
    lines = deployment.frontend.lines_matching(_ROUTE, 9, start=num_lines)
    assert len(lines) == 9
    routes = [_ROUTE.search(line).groups() for line in lines]  # type: ignore[union-attr]
    cached = [tuple(map(int, _CACHED.search(line).groups())) for line in lines]  # type: ignore[union-attr]
    for c in range(3):
        assert routes[3 + c] == routes[c] and routes[6 + c] == routes[c], routes
        for turn in (1, 2):
            on_prefill, on_decode = cached[3 * turn + c]
            assert on_prefill > 0 and on_decode > 0, lines[3 * turn + c]
    assert all(on_decode == 0 for _, on_decode in cached[:3])
    deployment.wait_free_blocks(start)


def request_for(token_ids: list[int], max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=token_ids,
        sampling=sampling_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ),
    )


def test_decode_killed_mid_request_fails_only_its_request(deployment: Deployment) -> None:
    start = deployment.settled_free_blocks()
    stub = deployment.stub()
    # Seeds no earlier test used: no cached prefix draws both to one instance.
    calls = [stub.Generate(request(40, 3000, seed=s), timeout=60) for s in (101, 102)]
    for call in calls:
        assert next(call).token_ids  # both running
    running = [deployment.decode_info(i).num_running for i in (0, 1)]
    assert running == [1, 1], "the two requests should have gone to different decode instances"

    killed = threading.Event()
    outcomes: list[object] = [None, None]

    def follow(i: int) -> None:
        """Read until the call fails, or until it streamed 30 tokens after the kill."""
        num_after_kill = 0
        try:
            for response in calls[i]:
                if killed.is_set():
                    num_after_kill += len(response.token_ids)
                    if num_after_kill >= 30:
                        outcomes[i] = "alive"
                        return
            outcomes[i] = "finished"
        except grpc.RpcError as err:
            outcomes[i] = (err, time.monotonic())

    readers = [threading.Thread(target=follow, args=(i,)) for i in (0, 1)]
    for reader in readers:
        reader.start()
    victim, survivor = deployment.decodes
    killed_at = time.monotonic()
    victim.proc.kill()
    killed.set()
    for reader in readers:
        reader.join(timeout=30)
    failed = [o for o in outcomes if isinstance(o, tuple)]
    assert len(failed) == 1 and "alive" in outcomes, outcomes
    err, failed_at = failed[0]
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    assert "decode" in err.details()
    assert failed_at - killed_at < 5
    for call in calls:
        call.cancel()

    # Nothing leaked on the instances still alive; new requests go to the surviving decode.
    alive = [*deployment.prefills, survivor]
    deployment.wait_free_blocks({a: start[a] for a in (s.address for s in alive)}, alive)
    for i in range(3):
        responses = list(stub.Generate(request(12, 4, seed=10 + i), timeout=30))
        assert responses[-1].usage.completion_tokens == 4
    # The dead decode's KV pool in /dev/shm is unlinked (prefill's sweep finds its owner gone)
    # and the survivor's is still there.
    deadline = time.monotonic() + 5
    while segments_of(victim.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert segments_of(victim.proc.pid) == []
    assert len(segments_of(survivor.proc.pid)) == 1
