"""Valid traffic as a busy deployment meets it, against real processes on the demo model: two
prefill and two decode instances, the decode pools small enough that long requests outgrow them
together (refusals the frontend queues, preemptions, resumes), prompts that share prefixes
(prefix caching, cache-aware routing), and a seeded random mix of what callers do at once:

- gRPC streams read to the end, at random priorities: greedy, so each must give the tokens the
  single-process engine gives its prompt alone;
- streams the caller cancels after a few responses, or cut by a short deadline (some while
  prefill computes their prompts chunk by chunk): what came before the end must be the start
  of those tokens;
- HTTP streams whose client closes the connection after a few chunks, and unstreamed HTTP
  calls whose client stops waiting;
- seeded sampling, each request sent twice (twins must agree whatever their batches), and
  HTTP completions of n=2 whose second choice must be what gRPC draws with the seed + 1;
- JSON-schema constrained answers at temperature 1 over gRPC and HTTP, and HTTP chats whose
  tool_choice is required: each answer, each call's arguments, must validate.

Afterwards every KV block is back on every instance, nothing runs or waits, nothing is left
preempted, and the traffic reached what it is meant to: decode preempted, prefill's prefix
cache served the shared prefixes. The frontend logged and counted each end as its caller saw
it (mili_frontend_requests_finished_total), and decode's trace says how many tokens it made for
each request: as many as the caller got for a whole answer, and hardly more for one the caller
left (cut calls ask CUT_TOKENS, so a request decode went on with after its caller left would
show hundreds more)."""

from __future__ import annotations

import http.client
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import jsonschema
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from tests.e2e.conftest import Deployment, deploy, end_lines, served_model
from tests.otlp_receiver import Receiver, serving
from tests.service_process import ServiceProcess, counted, counted_by

pytestmark = pytest.mark.slow

SEED = 20261128
NUM_BLOCKS = 48  # of 16 tokens a decode instance: two long requests outgrow it together
LONG_TOKENS = 400  # a long request's max_tokens: past the 256 outputs admission reserves
CUT_TOKENS = 600  # the max_tokens of a call its caller cuts short
PREFILL_CHUNK = 128  # prefill's --max-batch-tokens: the longer prompts (up to 448) take chunks
# Tokens decode may make for a request after its caller left, before the cancel reaches it (0 or
# 1 in runs here; a request never cancelled makes hundreds more).
SLACK = 32
NUM_CALLERS = 8
# How each kind of greedy gRPC call may end
ENDS = {
    "greedy": ("FINISH_REASON_LENGTH",),
    "cancel": ("cancelled by the caller",),
    "deadline": ("FINISH_REASON_LENGTH", "DEADLINE_EXCEEDED"),
}
_END = end_lines("soak")  # the frontend's one log line a request: how it ended
# A call's end as the frontend counts it (mili_frontend_requests_finished_total) and logs it
OUTCOMES = {
    "FINISH_REASON_LENGTH": "length",
    "FINISH_REASON_STOP": "stop",
    "tool_calls": "stop",
    "cancelled by the caller": "CANCELLED",
    "closed by the client": "CANCELLED",
    "given up by the client": "CANCELLED",
}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"enum": ["C", "F"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["city", "unit"],
}


@dataclass
class Call:
    """One caller's request and what came back."""

    kind: str
    request_id: str
    prompt: list[int]
    max_tokens: int
    priority: int = 0
    seed: int = 0
    # cancel, disconnect: responses read before the caller goes; deadline: the call's deadline;
    # gone: how long the caller waits for a whole (unstreamed) answer; both in milliseconds
    after: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # an HTTP chat's tool calls, as JSON; n=2: the choices' texts, a JSON list
    num_tokens: int = 0  # got; over HTTP as the usage says (a stream cut short: so far)
    finish: str = ""  # a finish reason, or the status code that ended the call


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Receiver, int]]:
    with serving() as served:
        yield served


@pytest.fixture(scope="module")
def busy(
    demo_model_dir: Path, e2e_tokenizer: ServiceProcess, collector: tuple[Receiver, int]
) -> Iterator[Deployment]:
    traces = ("--otlp-endpoint", f"http://127.0.0.1:{collector[1]}")
    d = deploy(
        demo_model_dir,
        e2e_tokenizer,
        num_prefills=2,
        prefill_args=lambda i: (
            "--max-batch-tokens",
            str(PREFILL_CHUNK),
            "--max-queued-tokens",
            "8192",
        ),
        num_decodes=2,
        engine_args=("--dtype", "float32"),
        decode_args=("--num-blocks", str(NUM_BLOCKS), "--metrics-port", "0", *traces),
        frontend_args=("--http-port", "0", "--metrics-port", "0"),
    )
    yield d
    d.stop()


def plan(rng: random.Random) -> list[Call]:
    """The long requests first (they start together and outgrow the pools), the rest shuffled."""
    prefixes = [[rng.randrange(800) for _ in range(48)] for _ in range(3)]

    def prompt(longest: int) -> list[int]:
        return rng.choice(prefixes) + [rng.randrange(800) for _ in range(rng.randint(1, longest))]

    def call(kind: str, max_tokens: int, longest: int = 24, **given: int) -> Call:
        return Call(kind, "", prompt(longest), max_tokens, **given)

    calls = [call("greedy", LONG_TOKENS, priority=rng.randint(0, 2)) for _ in range(4)]
    rest = [call("greedy", rng.randint(4, 48), priority=rng.randint(0, 2)) for _ in range(12)]
    rest += [call("cancel", CUT_TOKENS, after=rng.randint(1, 4)) for _ in range(6)]
    rest += [call("deadline", CUT_TOKENS, after=rng.randint(200, 2500)) for _ in range(6)]
    rest += [call("disconnect", CUT_TOKENS, after=rng.randint(1, 4)) for _ in range(5)]
    rest += [call("gone", CUT_TOKENS, after=rng.randint(300, 1200)) for _ in range(3)]
    # prompts prefill computes in several chunks, read to the end or cut on the way
    rest += [call("greedy", rng.randint(4, 32), longest=400) for _ in range(3)]
    rest += [call("deadline", 64, longest=400, after=rng.randint(20, 400)) for _ in range(3)]
    for _ in range(3):
        twin = call("seeded", 32, seed=rng.randrange(2**32))
        rest += [twin, replace(twin, tokens=[])]  # a list of its own
    rest += [call("json", 200, seed=rng.randrange(2**32)) for _ in range(3)]
    rest += [call("json_http", 200, seed=rng.randrange(2**32)) for _ in range(2)]
    rest += [call("tools", 200, seed=rng.randrange(2**32)) for _ in range(2)]
    for _ in range(2):
        n2 = call("n2", 16, seed=rng.randrange(2**32 - 1))
        rest += [n2, replace(n2, kind="choice1", seed=n2.seed + 1, tokens=[])]
    rng.shuffle(rest)
    calls += rest
    for i, c in enumerate(calls):
        c.request_id = f"soak-{i}"
    return calls


def grpc_call(d: Deployment, call: Call) -> None:
    sampling = sampling_pb2.SamplingParams(max_tokens=call.max_tokens, ignore_eos=True)
    if call.kind in ("seeded", "choice1", "json"):
        sampling.temperature, sampling.top_k, sampling.seed = 1.0, 40, call.seed
        sampling.ignore_eos = call.kind != "json"
    else:
        sampling.temperature = 0.0
    if call.kind == "json":
        sampling.json_schema = json.dumps(SCHEMA)
    request = generation_pb2.GenerateRequest(
        request_id=call.request_id, token_ids=call.prompt, sampling=sampling, priority=call.priority
    )
    timeout = call.after / 1000 if call.kind == "deadline" else 120
    stream = d.stub().Generate(request, timeout=timeout)
    try:
        for i, response in enumerate(stream, 1):
            call.tokens += response.token_ids
            call.num_tokens = len(call.tokens)
            call.text += response.text
            if response.finish_reason:
                call.finish = sampling_pb2.FinishReason.Name(response.finish_reason)
            if call.kind == "cancel" and i == call.after:
                stream.cancel()
                call.finish = "cancelled by the caller"
                return
    except grpc.RpcError as e:
        call.finish = e.code().name


def http_call(url: str, model: str, call: Call) -> None:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    timeout = call.after / 1000 if call.kind == "gone" else 120
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    if call.kind == "json_http":
        schema = {"name": "weather", "schema": SCHEMA, "strict": True}
        path, body = "/v1/chat/completions", {
            "model": model,
            "messages": [{"role": "user", "content": f"Weather? {call.prompt[:8]}"}],
            "response_format": {"type": "json_schema", "json_schema": schema},
            "chat_template_kwargs": {"enable_thinking": False},
            "temperature": 1.0, "seed": call.seed, "max_tokens": call.max_tokens,
        }  # fmt: skip
    elif call.kind == "tools":
        path, body = "/v1/chat/completions", {
            "model": model,
            "messages": [{"role": "user", "content": f"Weather? {call.prompt[:8]}"}],
            "tools": [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}],
            "tool_choice": "required",
            "chat_template_kwargs": {"enable_thinking": False},
            "temperature": 1.0, "seed": call.seed, "max_tokens": call.max_tokens,
        }  # fmt: skip
    elif call.kind == "n2":  # sampled as the gRPC calls are: choice i draws from seed + i
        path, body = "/v1/completions", {
            "model": model, "prompt": call.prompt, "max_tokens": call.max_tokens, "n": 2,
            "temperature": 1.0, "top_k": 40, "seed": call.seed, "ignore_eos": True,
        }  # fmt: skip
    else:
        path, body = "/v1/completions", {
            "model": model, "prompt": call.prompt, "max_tokens": call.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": call.kind == "disconnect",
        }  # fmt: skip
        if call.kind == "disconnect":
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    headers = {"Content-Type": "application/json", "X-Request-Id": call.request_id}
    try:
        conn.request("POST", path, json.dumps(body), headers)
        reply = conn.getresponse()
        if call.kind == "disconnect" and reply.status == 200:
            events = 0
            while events < call.after:
                line = reply.fp.readline()
                assert line, "the stream ended before the client went away"
                if line.startswith(b"data: {"):
                    events += 1
                    call.num_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            call.finish = "closed by the client"
            return
        payload = json.loads(reply.read())
        assert reply.status == 200, payload
        choice = payload["choices"][0]
        if call.kind == "tools":
            call.text = json.dumps(choice["message"]["tool_calls"])
        elif call.kind == "n2":
            call.text = json.dumps([c["text"] for c in sorted(payload["choices"], key=_index)])
        else:
            call.text = choice["message"]["content"] if "message" in choice else choice["text"]
        call.finish, call.num_tokens = (
            choice["finish_reason"],
            payload["usage"]["completion_tokens"],
        )
    except TimeoutError:  # only a call that gives up has a short timeout
        call.finish = "given up by the client"
    finally:
        conn.close()  # the socket goes, what is left unread


def _index(choice: dict[str, Any]) -> int:
    return int(choice["index"])


def decode_tokens(receiver: Receiver) -> dict[str, int]:
    """Tokens decode made for each client request id, as its `decode request` spans say."""
    made: dict[str, int] = {}
    for service, span in receiver.snapshot():
        if service == "mili-decode" and span.name == "decode request":
            attributes = {a.key: a.value for a in span.attributes}
            rid = attributes["mili.client_request_id"].string_value
            count = attributes["mili.decode.num_output_tokens"].int_value
            made[rid] = made.get(rid, 0) + count
    return made


def test_a_seeded_mix_of_callers_gets_whole_answers_and_leaves_every_block_free(
    busy: Deployment,
    collector: tuple[Receiver, int],
    engine_greedy: Callable[[list[int], int], list[int]],
) -> None:
    start = busy.settled_free_blocks()
    calls = plan(random.Random(SEED))
    url = busy.frontend.http_url
    model = served_model(url)

    def run(call: Call) -> None:
        if call.kind in ("disconnect", "gone", "json_http", "tools", "n2"):
            http_call(url, model, call)
        else:
            grpc_call(busy, call)

    began = time.monotonic()
    with ThreadPoolExecutor(NUM_CALLERS) as callers:
        list(callers.map(run, calls))
    took = f"traffic took {time.monotonic() - began:.0f} s"

    twins: dict[tuple[int, ...], list[int]] = {}
    for call in calls:
        what = f"{call.kind} {call.request_id} ({took}): {call.finish}"
        if call.kind in ("greedy", "cancel", "deadline"):
            assert call.finish in ENDS[call.kind], what
            # read to the end, or what came before the end the caller set
            whole = call.finish == "FINISH_REASON_LENGTH"
            expected = engine_greedy(call.prompt, call.max_tokens if whole else len(call.tokens))
            assert call.tokens == expected, what
        elif call.kind == "seeded":
            assert call.finish == "FINISH_REASON_LENGTH", what
            assert len(call.tokens) == call.max_tokens, what
            twin = twins.setdefault((*call.prompt, call.seed), call.tokens)
            assert call.tokens == twin, what
        elif call.kind in ("json", "json_http"):
            assert call.finish in ("FINISH_REASON_STOP", "stop"), what
            jsonschema.validate(json.loads(call.text), SCHEMA)
        elif call.kind == "tools":
            assert call.finish == "tool_calls", what
            for tool_call in json.loads(call.text):
                assert tool_call["function"]["name"] == "weather", what
                jsonschema.validate(json.loads(tool_call["function"]["arguments"]), SCHEMA)
        elif call.kind == "n2":
            assert call.finish == "length", what
            (choice1,) = (c for c in calls if c.kind == "choice1" and c.prompt == call.prompt)
            assert json.loads(call.text)[1] == choice1.text, what
        elif call.kind == "choice1":
            assert call.finish == "FINISH_REASON_LENGTH", what
        elif call.kind == "disconnect":
            assert call.finish == "closed by the client", what
        else:
            assert call.finish in ("given up by the client", "length"), what
    assert len(twins) == 3

    # Everything ended: every block back, nothing running, waiting or preempted.
    assert busy.settled_free_blocks(timeout_s=30) == start
    urls = [d.metrics_url for d in busy.decodes]
    assert sum(counted(u, "mili_decode_preempted_requests") for u in urls) == 0
    assert sum(counted(u, "mili_decode_preemptions_total") for u in urls) >= 1, took
    hits = [busy.prefill_info(i).prefix_cache.hit_tokens for i in range(len(busy.prefills))]
    assert sum(hits) > 0, hits  # the shared prefixes came from prefill's cache
    # The frontend's log line and count of each end agree with its caller, but that a call
    # time cut (a deadline, a client that stopped waiting) just as its last token came may
    # have ended whole there.
    names = [f"{c.request_id}.{i}" for c in calls if c.kind == "n2" for i in (0, 1)]
    names += [c.request_id for c in calls if c.kind != "n2"]
    lines = busy.frontend.lines_matching(_END, len(names))
    ends = {m["rid"]: m["finish"] or m["code"] or m["cut"] for m in map(_END.search, lines) if m}
    assert sorted(ends) == sorted(names), lines
    for call in calls:
        seen = OUTCOMES.get(call.finish, call.finish)
        for rid in (
            [f"{call.request_id}.{i}" for i in (0, 1)] if call.kind == "n2" else [call.request_id]
        ):
            timed = call.finish in ("DEADLINE_EXCEEDED", "given up by the client")
            assert ends[rid] == seen or (timed and ends[rid] == "length"), (rid, seen, ends[rid])
    finished = "mili_frontend_requests_finished_total"
    assert counted_by(busy.frontend.metrics_url, finished, "outcome") == Counter(ends.values())
    # and the deployment serves on
    after = replace(calls[0], request_id="after", max_tokens=8, tokens=[])
    grpc_call(busy, after)
    assert after.tokens == engine_greedy(after.prompt, 8)

    # Decode stopped making tokens for every caller that left.
    busy.stop()  # decode flushes its spans as it exits
    made = decode_tokens(collector[0])
    for call in calls:
        rid = call.request_id
        if call.kind == "n2":  # its choices' generations: `{rid}.0` and `{rid}.1`
            made[rid] = made[f"{rid}.0"] + made[f"{rid}.1"]
        what = (
            f"{call.kind} {rid}: {call.finish}, decode made {made.get(rid)}, {call.num_tokens} got"
        )
        if call.finish in ("cancelled by the caller", "DEADLINE_EXCEEDED", "closed by the client"):
            assert made.get(rid, 0) <= call.num_tokens + SLACK, what
        elif call.finish == "given up by the client":  # it got nothing: it ended short
            assert made.get(rid, 0) < call.max_tokens, what
        else:
            assert made[rid] == call.num_tokens, what
