"""The token path's fallbacks and bounds with real processes: a decode instance that does not
serve GenerateStream (the frontend sends each request on a Generate call of its own), and a
frontend's --max-buffered-tokens under a deliberately slow reader."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from mili.common.v1 import sampling_pb2
from mili.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.frontend.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import DECODE_ARGS, Deployment, deploy
from tests.e2e.test_pipeline import greedy, random_prompt
from tests.service_process import ServiceProcess

# A client whose HTTP/2 window holds ~1 KiB: the frontend's writes wait for it to read, as they
# would for a slow client once the transport's buffers are full.
_SLOW_CLIENT_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
_FALLBACK_LOG = "does not serve GenerateStream"


@pytest.fixture(scope="module")
def old_decode(demo_model_dir: Path, e2e_tokenizer: ServiceProcess) -> Iterator[Deployment]:
    """The pipeline with a decode instance that answers GenerateStream UNIMPLEMENTED."""
    d = deploy(
        demo_model_dir,
        e2e_tokenizer,
        engine_args=("--dtype", "float32"),
        decode_args=(*DECODE_ARGS, "--no-generate-stream"),
    )
    yield d
    d.stop()


def _tokens(stub: generation_pb2_grpc.GenerationServiceStub, prompt: list[int]) -> list[int]:
    responses = list(stub.Generate(greedy(prompt), timeout=60))
    assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == len([t for r in responses for t in r.token_ids])
    return [t for r in responses for t in r.token_ids]


def test_the_decode_flag_refuses_generate_stream(old_decode: Deployment) -> None:
    with grpc.insecure_channel(old_decode.decodes[0].address) as channel:
        call = decode_pb2_grpc.DecodeServiceStub(channel).GenerateStream(
            iter([decode_pb2.GenerateStreamRequest()]), timeout=10
        )
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_requests_fall_back_to_generate_with_equal_tokens_and_one_log_line(
    old_decode: Deployment, pipeline: Deployment
) -> None:
    prompts = [random_prompt(n, seed=100 + n) for n in (5, 17, 33, 40)]
    # All at once on the fresh frontend: they are opened on its first GenerateStream together,
    # and move to Generate calls when decode refuses it; later ones go there directly.
    with ThreadPoolExecutor(len(prompts)) as pool:
        first = list(pool.map(lambda p: _tokens(old_decode.stub(), p), prompts))
    later = [_tokens(old_decode.stub(), p) for p in prompts[:2]]
    streamed = [_tokens(pipeline.stub(), p) for p in prompts]  # a decode that multiplexes
    assert first == streamed
    assert later == streamed[:2]
    assert old_decode.frontend.stderr.count(_FALLBACK_LOG) == 1


def test_cancel_and_deadline_on_the_fallback_free_every_block(old_decode: Deployment) -> None:
    long = generation_pb2.GenerateRequest(
        token_ids=random_prompt(40, seed=7),
        sampling=sampling_pb2.SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True),
    )
    start = old_decode.free_blocks()
    call = old_decode.stub().Generate(long, timeout=60)
    for _, response in zip(range(3), call, strict=False):
        assert response.token_ids
    decode = old_decode.decodes[0].address
    assert old_decode.free_blocks()[decode] < start[decode]
    call.cancel()
    old_decode.wait_free_blocks(start)
    with pytest.raises(grpc.RpcError) as info:
        list(old_decode.stub().Generate(long, timeout=1.0))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    old_decode.wait_free_blocks(start)


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
