"""The token path's bounds with real processes: a frontend's --max-buffered-tokens under a
deliberately slow reader."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import Deployment
from tests.e2e.test_pipeline import greedy, random_prompt
from tests.service_process import ServiceProcess

# A client whose HTTP/2 window holds ~1 KiB: the frontend's writes wait for it to read, as they
# would for a slow client once the transport's buffers are full.
_SLOW_CLIENT_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


@pytest.fixture(scope="module")
def bounded_frontend(pipeline: Deployment) -> Iterator[ServiceProcess]:
    """A second frontend on the pipeline's services holding at most 8 ids per request."""
    frontend = ServiceProcess(
        "serve-frontend",
        "--port",
        "0",
        "--tokenizer",
        pipeline.tokenizer.address,
        "--prefill",
        ",".join(p.address for p in pipeline.prefills),
        "--decode",
        ",".join(d.address for d in pipeline.decodes),
        "--poll-interval",
        "0.5",
        "--max-buffered-tokens",
        "8",
    )
    yield frontend
    frontend.proc.send_signal(15)
    frontend.terminate(timeout_s=30)


def _read_after_a_pause(address: str, request: generation_pb2.GenerateRequest) -> list[object]:
    """Read one message, stop reading while decode generates the rest, then read it all."""
    with grpc.insecure_channel(address, options=_SLOW_CLIENT_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        deadline = time.monotonic() + 20
        while not stub.Info(generation_pb2.InfoRequest(), timeout=5).max_context_tokens:
            assert time.monotonic() < deadline, "the frontend never saw a decode instance"
            time.sleep(0.1)
        responses = []
        for response in stub.Generate(request, timeout=120):
            if not responses:
                time.sleep(3.0)  # decode makes ~100 tokens/s here: the rest waits for us
            responses.append(response)
    return responses


def test_a_slow_reader_gets_every_token_once_in_order_within_the_flag_bound(
    bounded_frontend: ServiceProcess, pipeline: Deployment
) -> None:
    num_tokens = 300
    request = greedy(random_prompt(12, seed=3), max_tokens=num_tokens)
    expected = [t for r in pipeline.stub().Generate(request, timeout=60) for t in r.token_ids]
    bounded = _read_after_a_pause(bounded_frontend.address, request)
    unbounded = _read_after_a_pause(pipeline.frontend.address, request)  # the default, 1024
    for responses in (bounded, unbounded):
        assert [t for r in responses for t in r.token_ids] == expected  # once each, in order
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == num_tokens
        assert not any(r.finish_reason for r in responses[:-1])
    # Each message takes everything the frontend held for the client. It stops pulling once
    # it holds 8 ids; the delta that reached the bound may bring a few more (decode merges a
    # request's tokens into one event while its stream lags), never a whole backlog, which is
    # what the default bound lets through in one message.
    assert max(len(r.token_ids) for r in bounded) <= 16
    assert max(len(r.token_ids) for r in unbounded) > 64
