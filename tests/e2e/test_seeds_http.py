"""The seeds' REST endpoints (/generate, /status, /health) on a real deployment, over a raw
HTTP client (http.client): the documented fields, values and statuses, and the same truth as
the gRPC API (greedy text, the caller's request id, health)."""

from __future__ import annotations

import http.client
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from tests.e2e.conftest import Deployment, deploy
from tests.service_process import ServiceProcess, counted

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def seeds(demo_model_dir: Path, e2e_tokenizer: ServiceProcess) -> Iterator[Deployment]:
    d = deploy(
        demo_model_dir,
        e2e_tokenizer,
        engine_args=("--dtype", "float32"),
        frontend_args=("--http-port", "0", "--metrics-port", "0"),
    )
    yield d
    d.stop()


def connect(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)


def call(
    url: str, method: str, path: str, body: object = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    conn = connect(url)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, body=data, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def complete(deployment: Deployment, request_id: str, max_tokens: int) -> Any:
    request = generation_pb2.CompleteRequest(
        request_id=request_id,
        prompt=PROMPT,
        sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0),
    )
    return deployment.stub().Complete(request, timeout=60)


def test_generate_is_grpc_complete_and_its_status_is_completed(seeds: Deployment) -> None:
    url = seeds.frontend.http_url
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "request_id": "seed-1"}
    code, reply = call(url, "POST", "/generate", body)
    assert code == 200, reply
    expected = complete(seeds, "grpc-1", 8)
    assert reply["request_id"] == "seed-1"
    assert reply["generated_text"] == expected.text
    assert reply["tokens"] == list(expected.token_ids)
    assert reply["prompt_tokens"] == expected.usage.prompt_tokens
    assert reply["completion_tokens"] == len(reply["tokens"])
    assert reply["total_tokens"] == reply["prompt_tokens"] + len(reply["tokens"])
    assert reply["finish_reason"] in ("stop", "length")
    assert (len(reply["tokens"]) == 8) == (reply["finish_reason"] == "length")

    # Both requests are this frontend's, whichever API ran them.
    for request_id in ("seed-1", "grpc-1"):
        code, status = call(url, "GET", f"/status/{request_id}")
        assert (code, status) == (
            200,
            {
                "request_id": request_id,
                "status": "completed",
                "tokens_generated": len(reply["tokens"]),
                "tokens_remaining": 0,
                "finish_reason": reply["finish_reason"],
            },
        )
    code, status = call(url, "GET", "/status/never-sent")
    assert (code, status) == (
        404,
        {
            "request_id": "never-sent",
            "status": "not_found",
            "tokens_generated": 0,
            "tokens_remaining": 0,
        },
    )


def test_the_request_id_header_names_a_request_without_one(seeds: Deployment) -> None:
    url = seeds.frontend.http_url
    body = {"prompt": PROMPT, "max_tokens": 2}
    code, reply = call(url, "POST", "/generate", body, {"X-Request-Id": "from-header"})
    assert (code, reply["request_id"]) == (200, "from-header")
    code, reply = call(url, "POST", "/generate", body)
    assert code == 200 and len(reply["request_id"]) == 32  # a fresh one (uuid4 hex)


def test_the_body_request_id_is_echoed_and_the_tokens_counted(seeds: Deployment) -> None:
    """A /generate body's request_id is the id X-Request-Id echoes (the one its logs name), its
    tokens count in mili_frontend_generated_tokens_total as the other APIs' do, and a header
    id that is not printable ASCII is replaced by a fresh one, not a 500."""
    url = seeds.frontend.http_url
    metrics = seeds.frontend.metrics_url
    before = counted(metrics, "mili_frontend_generated_tokens_total")
    for stream in (False, True):
        conn = connect(url)
        try:
            # Greedy: sampled at temperature 1, the demo model can end a request on EOS early.
            body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
            body |= {"request_id": f"body-{stream}", "stream": stream}
            conn.request("POST", "/generate", body=json.dumps(body))
            reply = conn.getresponse()
            reply.read()
            assert reply.status == 200 and reply.headers["X-Request-Id"] == f"body-{stream}"
        finally:
            conn.close()
    assert counted(metrics, "mili_frontend_generated_tokens_total") - before == 6
    conn = connect(url)
    try:
        conn.putrequest("POST", "/generate")
        conn.putheader("X-Request-Id", b"rid\xffX")  # not text: aiohttp hands it in garbled
        payload = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
        conn.putheader("Content-Length", str(len(payload)))
        conn.endheaders(payload)
        reply = conn.getresponse()
        answer = json.loads(reply.read())
        assert reply.status == 200, answer
        assert answer["request_id"] == reply.headers["X-Request-Id"] != "ridX"
    finally:
        conn.close()


def read_events(reply: http.client.HTTPResponse) -> tuple[bytes, list[Any]]:
    raw = reply.read()
    # strip: a reader that took the first event's line leaves its blank line.
    events = [c.strip().removeprefix(b"data: ") for c in raw.split(b"\n\n") if c.strip()]
    return raw, [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


def test_a_stream_is_sse_with_the_plain_answer_in_its_deltas(seeds: Deployment) -> None:
    url = seeds.frontend.http_url
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "request_id": "s-1"}
    _, plain = call(url, "POST", "/generate", body)
    conn = connect(url)
    conn.request("POST", "/generate", body=json.dumps({**body, "stream": True}))
    reply = conn.getresponse()
    assert reply.status == 200
    assert reply.getheader("Content-Type") == "text/event-stream"
    raw, events = read_events(reply)
    conn.close()
    *deltas, totals, done = events
    assert done == "[DONE]"
    # Byte for byte: every event is `data: <json>` and a blank line, nothing else.
    again = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in [*deltas, totals])
    assert raw == again + b"data: [DONE]\n\n"
    assert all(set(d) == {"request_id", "text", "token_ids"} for d in deltas)
    assert {d["request_id"] for d in deltas} == {"s-1"}
    assert "".join(d["text"] for d in deltas) == plain["generated_text"]
    assert [t for d in deltas for t in d["token_ids"]] == plain["tokens"]
    assert totals == {
        "request_id": "s-1",
        "prompt_tokens": plain["prompt_tokens"],
        "completion_tokens": plain["completion_tokens"],
        "total_tokens": plain["total_tokens"],
        "finish_reason": plain["finish_reason"],
    }


def test_a_request_in_flight_is_processing_then_cancelled(seeds: Deployment) -> None:
    url = seeds.frontend.http_url
    free = seeds.free_blocks()
    max_tokens = 3000  # far more than the first event takes: still running when asked
    # Greedy: sampled, the demo model's EOS (~0.1% a token) ended it early now and then.
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": True,
        "request_id": "long",
        "temperature": 0,
    }
    conn = connect(url)
    conn.request("POST", "/generate", body=json.dumps(body))
    reply = conn.getresponse()
    assert reply.status == 200
    assert reply.readline().startswith(b"data: {")  # the first delta is out
    code, status = call(url, "GET", "/status/long")
    assert code == 200 and status["status"] == "processing", status
    assert status["tokens_generated"] >= 1
    assert status["tokens_generated"] + status["tokens_remaining"] == max_tokens
    conn.close()  # the client goes away: the request ends, its blocks come back
    deadline = time.monotonic() + 20
    while (status := call(url, "GET", "/status/long")[1])["status"] == "processing":
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    assert status["finish_reason"] == "cancelled" and status["tokens_remaining"] == 0
    assert 1 <= status["tokens_generated"] < max_tokens
    seeds.wait_free_blocks(free)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "top_p": 2.0}, "top_p"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 4096}, "max_tokens"),  # past the context window
        ({"prompt": PROMPT, "temperature": True}, "temperature"),
        ({"prompt": PROMPT, "stream": "yes"}, "stream"),
        ({"prompt": PROMPT, "max_token": 4}, "max_token"),
        # echoed in X-Request-Id: a line break there would break the response's headers
        ({"prompt": PROMPT, "request_id": "a\r\nX-Evil: 1"}, "request_id"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": ""}, "prompt"),
    ],
)
def test_a_bad_field_is_400_naming_it(seeds: Deployment, body: object, param: str) -> None:
    code, reply = call(seeds.frontend.http_url, "POST", "/generate", body)
    assert code == 400, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["param"] == param


def test_health_is_ok_with_a_route(seeds: Deployment) -> None:
    code, reply = call(seeds.frontend.http_url, "GET", "/health")
    assert (code, reply) == (200, {"status": "ok", "model_loaded": True, "scheduler_ready": True})


def test_health_is_503_without_services_and_while_draining(seeds: Deployment) -> None:
    # A frontend whose services are nowhere: it starts, and says it cannot serve.
    dead = ServiceProcess(
        "serve-frontend",
        *("--port", "0", "--http-port", "0", "--tokenizer", "127.0.0.1:1"),
        *("--prefill", "127.0.0.1:2", "--decode", "127.0.0.1:3"),
    )
    try:
        code, reply = call(dead.http_url, "GET", "/health")
        assert code == 503
        assert reply["status"] == "unavailable"
        assert (reply["model_loaded"], reply["scheduler_ready"]) == (False, False)
        assert "tokenizer" in reply["problem"]
        code, reply = call(dead.http_url, "POST", "/generate", {"prompt": PROMPT})
        assert code == 503, reply
    finally:
        assert dead.terminate() == 0, dead.stderr

    # A second frontend on the live services, drained with a request in flight.
    frontend = ServiceProcess(
        "serve-frontend",
        *("--port", "0", "--http-port", "0", "--poll-interval", "0.5", "--drain-timeout", "60"),
        *("--tokenizer", seeds.tokenizer.address, "--prefill", seeds.prefills[0].address),
        *("--decode", seeds.decodes[0].address),
    )
    try:
        url = frontend.http_url
        deadline = time.monotonic() + 20
        while call(url, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, frontend.stderr
            time.sleep(0.1)
        conn = connect(url)
        # Long enough to be in flight when the drain starts on a loaded machine (seconds).
        body = {"prompt": PROMPT, "max_tokens": 2000, "stream": True, "temperature": 0}
        conn.request("POST", "/generate", body=json.dumps(body))
        reply = conn.getresponse()
        assert reply.readline().startswith(b"data: {")
        frontend.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (health := call(url, "GET", "/health"))[0] != 503:
            assert time.monotonic() < deadline, health
            time.sleep(0.02)
        assert health[1]["problem"] == "the frontend is draining"
        code, refused = call(url, "POST", "/generate", {"prompt": PROMPT})
        assert (code, refused["error"]["type"]) == (503, "service_unavailable_error")
        _, events = read_events(reply)  # the request in flight still ends as it should
        assert events[-1] == "[DONE]"
        conn.close()
        # Signalled once already: a second SIGTERM during its last clean-up would be the
        # operator's "hurry" (terminate() sends one while it still runs), so wait instead.
        assert frontend.proc.wait(timeout=60) == 0, frontend.stderr
    finally:
        assert frontend.terminate() == 0, frontend.stderr
