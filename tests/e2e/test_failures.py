"""Refusals and failures: a KV layout mismatch is refused when the pair is set up (never
routed; FAILED_PRECONDITION naming both layouts once no compatible pair is left), a request
that finds the decode instance full waits in the frontend's admission queue until room frees
(or its deadline passes) and leaves no block behind, and a prefill killed mid-prefill fails its
request within seconds while decode gives back the reserved blocks.

prefill-0 matches the decode instance; prefill-1 runs with another block size. The decode
instance has 270 blocks of 16 tokens: a request of a 3800-token prompt needs 254 of them at
admission, more than are left beside one that runs (its blocks growing as it does).
"""

from __future__ import annotations

import re
import signal
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
    d = deploy(
        demo_model_dir,
        e2e_tokenizer,
        num_prefills=2,
        prefill_args=lambda i: ("--block-size", "32") if i == 1 else (),
        decode_args=("--num-blocks", "270"),
    )
    yield d
    d.stop()


def request(max_tokens: int = 4, num_prompt_tokens: int = 40) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=[100 + i % 700 for i in range(num_prompt_tokens)],  # the demo has 836 ids
        sampling=sampling_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ),
    )


def test_mismatched_pair_is_refused_loudly_and_never_routed(deployment: Deployment) -> None:
    good, bad = deployment.prefills
    log = deployment.frontend.stderr
    refusal = next(line for line in log.splitlines() if "REFUSING PAIR" in line)
    assert bad.address in refusal and deployment.decodes[0].address in refusal
    assert "block_size=32" in refusal and "block_size=16" in refusal
    for _ in range(4):
        responses = list(deployment.stub().Generate(request(), timeout=30))
        assert responses[-1].usage.completion_tokens == 4
    lines = deployment.frontend.lines_matching(_ROUTE, 4)
    routes = [m.group(1) for m in map(_ROUTE.search, lines) if m]
    assert routes[:4] == [good.address] * 4


def test_a_request_finding_decode_full_waits_for_room(deployment: Deployment) -> None:
    start = deployment.settled_free_blocks()
    stub = deployment.stub()
    # 40 prompt tokens: admitted with 19 blocks (and the first 256 outputs), 253 at the end
    holder = stub.Generate(request(4000), timeout=60)
    assert next(holder).token_ids
    # A request that fits still goes through beside it.
    assert list(stub.Generate(request(4), timeout=30))[-1].usage.completion_tokens == 4
    # One that does not fit (3800 + 250 tokens: 254 blocks) waits, reserving nothing: its
    # deadline passes in the queue...
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(250, 3800), timeout=1.0))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
    # ...or room frees (the holder goes) and it runs.
    waiter = stub.Generate(request(250, 3800), timeout=60)
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(next, waiter)
        time.sleep(1.0)
        assert not first.done()
        holder.cancel()
        assert first.result(timeout=30).token_ids
    waiter.cancel()
    deployment.wait_free_blocks(start)


def test_prefill_killed_mid_prefill_fails_the_request_fast(deployment: Deployment) -> None:
    decode = deployment.decodes[0]
    start = deployment.free_blocks([decode])
    victim = deployment.prefills[0]
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(list(deployment.stub().Generate(request(64), timeout=60)))
        except grpc.RpcError as err:
            outcome.append((err, time.monotonic()))

    # Frozen, the prefill holds the call without answering: the request is admitted by decode
    # (blocks reserved, waiting for KV) and sits in prefill when it dies.
    victim.proc.send_signal(signal.SIGSTOP)
    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 10
    while deployment.decode_info().num_waiting != 1:
        assert time.monotonic() < deadline, "decode never admitted the request"
        time.sleep(0.02)
    assert deployment.free_blocks([decode])[decode.address] < start[decode.address]
    killed_at = time.monotonic()
    victim.proc.kill()
    caller.join(timeout=30)
    assert outcome and isinstance(outcome[0], tuple), outcome
    err, failed_at = outcome[0]
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    assert "prefill" in err.details()
    assert failed_at - killed_at < 5
    deployment.wait_free_blocks(start, [decode])  # decode's reservation given back at once
    assert segments_of(victim.proc.pid) == []  # prefill owns no segment: it only maps decode's
    assert len(segments_of(decode.proc.pid)) == 1


def test_no_compatible_pair_left_is_failed_precondition_naming_both_layouts(
    deployment: Deployment,
) -> None:
    good = deployment.prefills[0]
    if good.proc.poll() is None:  # run alone, without the previous test
        good.proc.kill()
    # Only the mismatched prefill-1 is left; the frontend notices prefill-0 is gone within a
    # poll (a request racing that may still see UNAVAILABLE from it).
    deadline = time.monotonic() + 10
    while True:
        with pytest.raises(grpc.RpcError) as info:
            list(deployment.stub().Generate(request(), timeout=30))
        code = info.value.code()
        if code == grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert code == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
    details = info.value.details()
    assert "block_size=32" in details and "block_size=16" in details
    assert deployment.prefills[1].address in details
