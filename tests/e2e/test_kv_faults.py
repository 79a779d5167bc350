"""KV transfers damaged on the wire, end to end: real tokenizer, prefill, decode and frontend
processes, with a gRPC proxy (tests/e2e/fault_proxy.py) in front of the decode instance, once
for each KV transport (shm: prefill writes decode's pool in shared memory; grpc: the bytes in
the chunks). The
frontend is given the proxy as its decode address, so its Generate calls and prefill's KV
(the destination the frontend hands prefill) both go through it.

For one chosen request the proxy corrupts a chunk (one byte of `data`, crc32 untouched), drops
the commit, or cuts the transfer after its first chunk. Each time:

  * that request's client gets the documented status (DATA_LOSS for a corrupt chunk or a
    transfer ending without its commit, UNAVAILABLE for a transfer that broke off) within a few
    seconds, not after the 30 s KV lease;
  * requests running beside it (one already decoding, others sent at the same moment, or
    already streaming for the cut) finish with the tokens they get without any fault, and a
    later request still goes through;
  * every prefill and decode instance's Info.num_free_blocks returns to its starting value;
  * no service logged a traceback meanwhile.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from tests.e2e.conftest import Deployment, deploy
from tests.e2e.fault_proxy import FaultProxy
from tests.service_process import ServiceProcess

# The request under fault must fail well before decode's default 30 s KV lease would end it.
FAIL_WITHIN_S = 15.0  # half the lease: a loaded CI host gets room, the check its meaning
LONG_TOKENS = 48  # the request already decoding when the fault hits
SHORT_TOKENS = 24  # still decoding when the victim's transfer fails


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 37) % 800 + 1 for i in range(n)]


# (prompt, max_tokens) of the requests that run beside the damaged one.
LONG = (prompt(21, seed=1), LONG_TOKENS)
SHORTS = [(prompt(7, seed=2), SHORT_TOKENS), (prompt(40, seed=3), SHORT_TOKENS)]
VICTIM_PROMPT = prompt(53, seed=4)  # 3 blocks and a bit: 4 layers, 4 chunks


def greedy(
    token_ids: list[int], max_tokens: int, request_id: str = ""
) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=token_ids,
        sampling=sampling_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ),
    )


class Faulty:
    """The deployment, its proxy, the tokens each side request gets unharmed, and the free
    block counts before any request."""

    def __init__(self, deployment: Deployment, proxy: FaultProxy) -> None:
        self.d = deployment
        self.proxy = proxy
        self.start_blocks = deployment.settled_free_blocks()
        self.services = [*deployment.prefills, *deployment.decodes, deployment.frontend]
        self.log_marks = self.mark_logs()
        self.expected = {
            tuple(p): self.tokens(greedy(p, n)) for p, n in [LONG, *SHORTS, (VICTIM_PROMPT, 8)]
        }
        deployment.wait_free_blocks(self.start_blocks, timeout_s=5)

    def mark_logs(self) -> list[int]:
        return [len(s.stderr_lines) for s in self.services]

    def new_tracebacks(self) -> list[str]:
        """Log records with a traceback (or an unretrieved task error) since the last call.
        The pipeline's processes are shared with other modules: only what this module caused
        is looked at."""
        marks, self.log_marks = self.log_marks, self.mark_logs()
        bad = []
        for service, mark in zip(self.services, marks, strict=True):
            for record in log_records(service.stderr_lines[mark:]):
                if any(b in record for b in ("Traceback", "exception was never retrieved")):
                    bad.append(record)
        return bad

    def tokens(self, request: generation_pb2.GenerateRequest) -> list[int]:
        responses = list(self.d.stub().Generate(request, timeout=30))
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == request.sampling.max_tokens
        return [t for r in responses for t in r.token_ids]


@pytest.fixture(scope="module", params=["shm", "grpc"])
def transport_pipeline(
    request: pytest.FixtureRequest,
    demo_model_dir: Path,
    e2e_tokenizer: ServiceProcess,
) -> Iterator[tuple[Deployment, str]]:
    """(deployment, KV transport): the shared `pipeline` pairs over shm (one host, CPU); for
    grpc, a float32 deployment of our own whose prefill is told --kv-transport grpc."""
    if request.param == "shm":
        yield request.getfixturevalue("pipeline"), "shm"
        return
    d = deploy(
        demo_model_dir,
        e2e_tokenizer,
        engine_args=("--dtype", "float32"),
        prefill_args=lambda i: ("--kv-transport", "grpc"),
        num_spare_decodes=1,
    )
    try:
        yield d, "grpc"
    finally:
        d.stop()


@pytest.fixture(scope="module")
def faulty(transport_pipeline: tuple[Deployment, str]) -> Iterator[Faulty]:
    """The float32 pipeline's prefill and decode instances behind a frontend of our own whose
    decode address is the proxy (greedy tokens then do not depend on which requests share a
    batch), once per KV transport."""
    pipeline, transport = transport_pipeline
    wait_idle(pipeline)
    # On the address the prefill instances were told they may send KV to.
    port = int(pipeline.spare_decode_addresses[0].rpartition(":")[2])
    with FaultProxy(pipeline.decodes[0].address, port=port) as proxy:
        frontend = ServiceProcess(
            "serve-frontend",
            "--port",
            "0",
            "--tokenizer",
            pipeline.tokenizer.address,
            "--prefill",
            ",".join(p.address for p in pipeline.prefills),
            "--decode",
            proxy.address,
            "--poll-interval",
            "0.5",
        )
        d = Deployment(pipeline.tokenizer, pipeline.prefills, pipeline.decodes, frontend)
        try:
            d.wait_until_routable()
            f = Faulty(d, proxy)
            # The pair prefill -> proxy (-> decode) took the transport under test.
            assert d.prefill_info().kv_transports[proxy.address] == transport
            yield f
        finally:
            for channel in d._channels:
                channel.close()
            assert frontend.terminate() == 0, frontend.stderr


_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def log_records(lines: list[str]) -> list[str]:
    """Log lines grouped into records: a timestamped line and its continuation lines."""
    records: list[str] = []
    for line in lines:
        if _LOG_RECORD.match(line) or not records:
            records.append(line)
        else:
            records[-1] += line
    return records


def wait_idle(d: Deployment, timeout_s: float = 10.0) -> None:
    """Nothing left on decode or in prefill's queue (an earlier module's request may be
    ending), so the free counts read next are the starting values."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = d.decode_info()
        busy = info.num_running + info.num_waiting
        for prefill in d.prefills:
            with grpc.insecure_channel(prefill.address) as channel:
                stub = prefill_pb2_grpc.PrefillServiceStub(channel)
                busy += stub.Info(prefill_pb2.InfoRequest(), timeout=5).num_queued_tokens
        if busy == 0:
            return
        assert time.monotonic() < deadline, "the pipeline never went idle"
        time.sleep(0.05)


def run_with_fault(
    faulty: Faulty, fault: str, *, shorts_first: bool = False
) -> tuple[grpc.RpcError | list[int], float, list[list[int]]]:
    """Send the victim (with `fault` armed for it) while LONG is decoding and SHORTS are sent
    at the same moment (so some may share the victim's prefill batch), or with `shorts_first`
    once they are streaming too. Returns the victim's error (or its tokens when it did not
    fail), the seconds it took, and the side requests' tokens in order LONG, *SHORTS."""
    victim_id = f"victim-{fault}"
    faulty.proxy.arm(victim_id, fault)
    stub = faulty.d.stub()

    def victim() -> tuple[grpc.RpcError | list[int], float]:
        started = time.monotonic()
        try:
            responses = list(stub.Generate(greedy(VICTIM_PROMPT, 8, victim_id), timeout=30))
        except grpc.RpcError as err:
            return err, time.monotonic() - started
        return [t for r in responses for t in r.token_ids], time.monotonic() - started

    def short(i: int) -> Iterator[generation_pb2.GenerateResponse]:
        token_ids, max_tokens = SHORTS[i]
        return stub.Generate(greedy(token_ids, max_tokens, f"short-{fault}-{i}"), timeout=30)

    def tokens(responses: Iterator[generation_pb2.GenerateResponse]) -> list[int]:
        return [t for r in responses for t in r.token_ids]

    long_call = stub.Generate(greedy(*LONG, request_id=f"long-{fault}"), timeout=30)
    long_tokens = list(next(long_call).token_ids)  # LONG is in decode's running batch now
    with ThreadPoolExecutor(max_workers=1 + len(SHORTS)) as pool:
        if shorts_first:
            calls = [short(i) for i in range(len(SHORTS))]
            firsts = [next(call) for call in calls]  # streaming: admitted and prefilled
            victim_future = pool.submit(victim)
            shorts = [
                pool.submit(tokens, itertools.chain([first], call))
                for first, call in zip(firsts, calls, strict=True)
            ]
        else:
            victim_future = pool.submit(victim)
            shorts = [pool.submit(lambda i: tokens(short(i)), i) for i in range(len(SHORTS))]
        outcome, elapsed_s = victim_future.result(timeout=60)
        short_tokens = [s.result(timeout=60) for s in shorts]
    long_tokens += tokens(long_call)
    return outcome, elapsed_s, [long_tokens, *short_tokens]


def check_the_rest_went_on(faulty: Faulty, side_tokens: list[list[int]]) -> None:
    for (p, _), tokens in zip([LONG, *SHORTS], side_tokens, strict=True):
        assert tokens == faulty.expected[tuple(p)], len(p)
    # Every service's blocks come back (the damaged request's reservation on decode, its
    # prompt's blocks on prefill, and the side requests').
    faulty.d.wait_free_blocks(faulty.start_blocks, timeout_s=5)
    tracebacks = faulty.new_tracebacks()
    assert not tracebacks, "\n".join(tracebacks)
    # The pipeline still serves, the victim's prompt included (the fault was the wire's).
    assert faulty.tokens(greedy(VICTIM_PROMPT, 8)) == faulty.expected[tuple(VICTIM_PROMPT)]
    faulty.d.wait_free_blocks(faulty.start_blocks, timeout_s=5)


def assert_decode_refused_the_transfer(faulty: Faulty, request_id: str) -> None:
    """TransferKv itself ended with DATA_LOSS (kv.proto), when the proxy saw its end: it does
    not when the frontend, failing the request on decode's Generate error first, cancelled
    prefill's call before decode's answer came back through the proxy."""
    for code, details in faulty.proxy.statuses(request_id):
        assert code == grpc.StatusCode.DATA_LOSS, details


@pytest.mark.parametrize("fault", ["corrupt_first", "corrupt_last"])
def test_corrupt_chunk_fails_its_request_with_data_loss(faulty: Faulty, fault: str) -> None:
    outcome, elapsed_s, side_tokens = run_with_fault(faulty, fault)
    assert isinstance(outcome, grpc.RpcError), f"the corrupted request succeeded: {outcome}"
    assert outcome.code() == grpc.StatusCode.DATA_LOSS, outcome.details()
    assert "checksum mismatch" in outcome.details()
    assert elapsed_s < FAIL_WITHIN_S, elapsed_s
    which = 0 if fault == "corrupt_first" else 3  # the demo model: 4 layers, 1 prompt chunk
    assert faulty.proxy.events(f"victim-{fault}") == [f"corrupted chunk {which}"]
    assert_decode_refused_the_transfer(faulty, f"victim-{fault}")
    check_the_rest_went_on(faulty, side_tokens)


def test_transfer_without_commit_is_data_loss(faulty: Faulty) -> None:
    outcome, elapsed_s, side_tokens = run_with_fault(faulty, "drop_commit")
    assert isinstance(outcome, grpc.RpcError), f"the request without commit succeeded: {outcome}"
    assert outcome.code() == grpc.StatusCode.DATA_LOSS, outcome.details()
    assert "without a commit" in outcome.details()
    assert elapsed_s < FAIL_WITHIN_S, elapsed_s
    assert faulty.proxy.events("victim-drop_commit") == ["dropped the commit"]
    assert_decode_refused_the_transfer(faulty, "victim-drop_commit")
    check_the_rest_went_on(faulty, side_tokens)


def test_transfer_cut_mid_stream_is_unavailable(faulty: Faulty) -> None:
    # The side requests are streaming before the cut: the frontend takes the instance that
    # reported UNAVAILABLE out of routing until its next Info poll (immediate), and a request
    # admitted in those few milliseconds would fail too.
    outcome, elapsed_s, side_tokens = run_with_fault(
        faulty, "cut_after_first_chunk", shorts_first=True
    )
    assert isinstance(outcome, grpc.RpcError), f"the cut-off request succeeded: {outcome}"
    # A transfer that breaks off is a peer gone (decode: "broke off mid-way"; prefill: decode
    # unreachable): UNAVAILABLE, retry the request.
    assert outcome.code() == grpc.StatusCode.UNAVAILABLE, outcome.details()
    assert "victim-cut_after_first_chunk" in outcome.details()
    assert elapsed_s < FAIL_WITHIN_S, elapsed_s
    assert faulty.proxy.events("victim-cut_after_first_chunk") == ["cut before chunk 1"]
    check_the_rest_went_on(faulty, side_tokens)


def test_frontend_logs_no_unretrieved_decode_read(faulty: Faulty) -> None:
    """Decode and prefill both report a corrupt chunk; when the frontend sees both at once it
    raises prefill's error and must still retrieve the finished read of decode's stream (it
    used not to, and asyncio logged 'Task exception was never retrieved')."""
    for i in range(6):
        victim_id = f"victim-unretrieved-{i}"
        faulty.proxy.arm(victim_id, "corrupt_last")
        with pytest.raises(grpc.RpcError) as info:
            list(faulty.d.stub().Generate(greedy(VICTIM_PROMPT, 8, victim_id), timeout=30))
        assert info.value.code() == grpc.StatusCode.DATA_LOSS, info.value.details()
    time.sleep(0.5)  # asyncio logs an unretrieved error when the task is collected
    assert faulty.new_tracebacks() == []
    faulty.d.wait_free_blocks(faulty.start_blocks, timeout_s=5)
