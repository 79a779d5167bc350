"""Instances killed under load, against real processes on the demo model: two prefill and two
decode instances, a frontend, and 8 callers sending a seeded mix of greedy calls (gRPC streams,
HTTP completions streamed and not; some prompts long enough for prefill to compute them in
chunks, some answers long enough to outgrow decode's small pools). One decode instance is
frozen and then killed with SIGKILL once a quarter of the calls are done, one prefill instance
once half are.

What each caller must see: a whole answer, the tokens the single-process engine gives its prompt
alone, or UNAVAILABLE naming the instance that went (over HTTP a 503, or an error event then
[DONE] once streaming) after the frontend had at least one token, the tokens before it the start
of that answer. A call that had no token yet
starts again on the instances left (pipeline.py), so it never fails; no call hangs. Afterwards
the instances left hold no block and run nothing, the frontend counted each end as its caller
saw it, and the deployment serves on.

A rolling restart under the same traffic: a decode instance, then a prefill instance stopped
with SIGTERM (each drains its calls) and started again on its address. With another of each
kind up, no caller sees an error at all, and both instances take work again."""

from __future__ import annotations

import http.client
import json
import random
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from tests.e2e.conftest import Deployment, deploy, end_lines, served_model
from tests.service_process import ServiceProcess, counted_by

pytestmark = pytest.mark.slow

SEED = 20261129
NUM_CALLERS = 8
NUM_BLOCKS = 64  # of 16 tokens a decode instance: the long answers outgrow it together
PREFILL_CHUNK = 128  # prefill's --max-batch-tokens: prompts of up to 400 tokens take chunks
HANG_S = 90  # every call's deadline: a call that reaches it hung
FROZEN_S = 0.3  # how long an instance is stopped (SIGSTOP) before it is killed
_END = end_lines("fault")  # the frontend's one log line a request: how it ended


@dataclass
class Call:
    """One caller's request and what came back."""

    kind: str  # grpc; http (streamed), http_whole (not streamed)
    request_id: str
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)  # gRPC
    text: str = ""
    num_tokens: int = 0  # got: the usage's count over HTTP (0 for an unstreamed failure)
    end: str = ""  # length, or the status code that ended the call (HTTP: the error's type)
    details: str = ""  # the error's message


@pytest.fixture
def fragile(demo_model_dir: Path, e2e_tokenizer: ServiceProcess) -> Iterator[Deployment]:
    """A deployment of its own for each test: both take instances down."""
    d = deploy(
        demo_model_dir,
        e2e_tokenizer,
        num_prefills=2,
        prefill_args=lambda i: ("--max-batch-tokens", str(PREFILL_CHUNK)),
        num_decodes=2,
        engine_args=("--dtype", "float32"),
        decode_args=("--num-blocks", str(NUM_BLOCKS)),
        frontend_args=("--http-port", "0", "--metrics-port", "0"),
    )
    yield d
    d.stop()


def plan(rng: random.Random) -> list[Call]:
    prefixes = [[rng.randrange(800) for _ in range(48)] for _ in range(3)]

    def call(kind: str, max_tokens: int, longest: int = 24) -> Call:
        prompt = rng.choice(prefixes) + [rng.randrange(800) for _ in range(rng.randint(1, longest))]
        return Call(kind, "", prompt, max_tokens)

    calls = [call("grpc", rng.randint(8, 160)) for _ in range(34)]
    calls += [call("grpc", 300) for _ in range(4)]
    calls += [call("grpc", rng.randint(8, 48), longest=400) for _ in range(6)]
    calls += [call("http", rng.randint(8, 96)) for _ in range(6)]
    calls += [call("http_whole", rng.randint(8, 96)) for _ in range(4)]
    rng.shuffle(calls)
    for i, c in enumerate(calls):
        c.request_id = f"fault-{i}"
    return calls


def until_busy(d: Deployment, victim: ServiceProcess) -> None:
    """Until `victim` has work: prompt tokens queued or computing (prefill), requests running or
    waiting for their KV (decode)."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        if victim in d.prefills:
            if d.prefill_info(d.prefills.index(victim)).num_queued_tokens > 0:
                return
        else:
            info = d.decode_info(d.decodes.index(victim))
            if info.num_running + info.num_waiting > 0:
                return
        time.sleep(0.005)
    pytest.fail(f"{victim.address} had no work for {HANG_S} s")


def grpc_call(d: Deployment, call: Call) -> None:
    sampling = sampling_pb2.SamplingParams(
        max_tokens=call.max_tokens, temperature=0.0, ignore_eos=True
    )
    request = generation_pb2.GenerateRequest(
        request_id=call.request_id, token_ids=call.prompt, sampling=sampling
    )
    try:
        for response in d.stub().Generate(request, timeout=HANG_S):
            call.tokens += response.token_ids
            call.text += response.text
            if response.finish_reason:
                call.end = sampling_pb2.FinishReason.Name(response.finish_reason)
    except grpc.RpcError as e:
        call.end, call.details = e.code().name, e.details() or ""
    call.num_tokens = len(call.tokens)


def http_call(url: str, model: str, call: Call) -> None:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    body = {
        "model": model, "prompt": call.prompt, "max_tokens": call.max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": call.kind == "http",
    }  # fmt: skip
    if call.kind == "http":
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=HANG_S)
    headers = {"Content-Type": "application/json", "X-Request-Id": call.request_id}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        reply = conn.getresponse()
        if call.kind == "http_whole":
            payload = json.loads(reply.read())
            if reply.status == 200:
                (choice,) = payload["choices"]
                call.text, call.end = choice["text"], choice["finish_reason"]
                call.num_tokens = payload["usage"]["completion_tokens"]
            else:
                call.end, call.details = payload["error"]["type"], payload["error"]["message"]
            return
        assert reply.status == 200, reply.read()
        for line in reply.fp:
            if line == b"data: [DONE]\n":
                return
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                call.end, call.details = event["error"]["type"], event["error"]["message"]
                continue
            if event.get("usage"):
                call.num_tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                call.text += choice["text"]
                call.end = choice["finish_reason"] or call.end
        call.end = "no [DONE]"
    finally:
        conn.close()


def send(
    d: Deployment,
    calls: list[Call],
    act: Callable[[ServiceProcess], None],
    victims: list[ServiceProcess],
) -> str:
    """`calls` from NUM_CALLERS callers at once, while `act` is done to the first of `victims`
    once a quarter of the calls are done and to the second once half are (each in a thread of
    its own); returns how long it all took, for messages."""
    model = served_model(d.frontend.http_url)
    num_done = 0
    progress = threading.Condition()
    errors: list[BaseException] = []  # what the acts raised (a thread's own is only a warning)

    def run(call: Call) -> None:
        nonlocal num_done
        try:
            if call.kind != "grpc":
                http_call(d.frontend.http_url, model, call)
            else:
                grpc_call(d, call)
        finally:
            with progress:
                num_done += 1
                progress.notify_all()

    def happen(after: int, victim: ServiceProcess) -> None:
        with progress:
            progress.wait_for(lambda: num_done >= after, timeout=HANG_S)
        try:
            act(victim)
        except BaseException as e:
            errors.append(e)

    began = time.monotonic()
    acts = [
        threading.Thread(target=happen, args=(after, victim))
        for after, victim in zip((len(calls) // 4, len(calls) // 2), victims, strict=True)
    ]
    for thread in acts:
        thread.start()
    try:
        with ThreadPoolExecutor(NUM_CALLERS) as callers:
            list(callers.map(run, calls))
    finally:  # the acts done before the deployment is stopped: nothing they start outlives it
        for thread in acts:
            thread.join(timeout=2 * HANG_S)
    assert not any(thread.is_alive() for thread in acts)
    if errors:
        raise errors[0]
    return f"traffic took {time.monotonic() - began:.0f} s"


def test_callers_get_whole_answers_or_a_clear_error_when_instances_die_under_load(
    fragile: Deployment, engine_greedy: Callable[[list[int], int], list[int]]
) -> None:
    d = fragile
    calls = plan(random.Random(SEED))
    victims = [d.decodes[0], d.prefills[1]]
    survivors = [d.prefills[0], d.decodes[1]]
    settled = d.settled_free_blocks()
    start = {s.address: settled[s.address] for s in survivors}

    def kill(victim: ServiceProcess) -> None:
        until_busy(d, victim)
        # Frozen a moment first, with its work and the calls routed to it meanwhile (the
        # frontend polls every 0.5 s), so that those calls are there when it dies.
        victim.proc.send_signal(signal.SIGSTOP)
        time.sleep(FROZEN_S)
        victim.proc.kill()

    took = send(d, calls, kill, victims)
    assert all(victim.proc.poll() is not None for victim in victims)

    # Every call ended whole, or with UNAVAILABLE naming what went after a token came (the
    # frontend's line says how many it had: an unstreamed call's caller sees none of them).
    lines = d.frontend.lines_matching(_END, len(calls), timeout_s=30)
    ends = {m["rid"]: m for m in map(_END.search, lines) if m}
    assert sorted(ends) == sorted(c.request_id for c in calls), lines
    for call in calls:
        what = f"{call.kind} {call.request_id} ({took}): {call.end} {call.details!r}"
        if call.kind == "grpc":
            whole = call.end == "FINISH_REASON_LENGTH"
            expected = engine_greedy(call.prompt, call.max_tokens if whole else len(call.tokens))
            assert call.tokens == expected, what
        else:
            whole = call.end == "length"
        if whole:
            assert call.num_tokens == call.max_tokens, what
            continue
        assert call.end in ("UNAVAILABLE", "service_unavailable_error"), what
        assert re.search(r"\b(prefill|decode)\b", call.details), what
        made = int(ends[call.request_id]["made"] or 0)
        assert made >= 1, f"failed before its first token, not retried: {what}"
        assert call.kind == "http_whole" or call.num_tokens >= 1, what

    # Each killed instance met calls: they failed naming it, or went elsewhere for it.
    failed = [c.request_id for c in calls if c.end not in ("FINISH_REASON_LENGTH", "length")]
    for victim in victims:
        met = [line for line in lines if f" at {victim.address}: UNAVAILABLE" in line]
        moved = [line for line in lines if "retried" in line or "failed" in line]
        assert met, f"no call met {victim.address} ({took}):\n{''.join(moved)}"
    # The frontend logged and counted each end as its caller saw it.
    for call in calls:
        m = ends[call.request_id]
        assert (m["finish"] or m["code"]) == (
            "length" if call.request_id not in failed else "UNAVAILABLE"
        ), (call.request_id, call.end, m.group(0))
    counts = counted_by(d.frontend.metrics_url, "mili_frontend_requests_finished_total", "outcome")
    assert counts == Counter(length=len(calls) - len(failed), UNAVAILABLE=len(failed)), counts

    # The instances left hold no block and run nothing; they serve on, HTTP as gRPC.
    d.wait_free_blocks(start, survivors, timeout_s=30)
    info = d.decode_info(1)
    assert (info.num_running, info.num_waiting) == (0, 0)
    for call in calls:
        if call.kind != "grpc":  # the whole answer's text, as gRPC gets it now
            again = Call("grpc", f"again-{call.request_id}", call.prompt, call.max_tokens)
            grpc_call(d, again)
            assert again.end == "FINISH_REASON_LENGTH", again
            if call.end == "length":
                assert call.text == again.text, call.request_id
            else:
                assert again.text.startswith(call.text), call.request_id
    d.wait_free_blocks(start, survivors, timeout_s=30)


def test_a_rolling_restart_under_load_fails_no_call(
    fragile: Deployment, engine_greedy: Callable[[list[int], int], list[int]]
) -> None:
    """A decode, then a prefill instance is stopped (SIGTERM: it drains) and started again on
    its address, as a rolling restart does, under the same traffic: with another of each kind
    up, no caller sees an error, and the instances started again take work."""
    d = fragile
    calls = plan(random.Random(SEED + 1))
    restarted: dict[str, int] = {}  # address -> the frontend's log lines before it came back

    def restart(victim: ServiceProcess) -> None:
        until_busy(d, victim)
        assert victim.terminate(timeout_s=60) == 0, victim.stderr[-3000:]
        args = list(victim.args)
        args[args.index("--port") + 1] = victim.address.rsplit(":", 1)[1]  # prefill's was 0
        kind = d.prefills if victim in d.prefills else d.decodes
        kind[kind.index(victim)] = ServiceProcess(*args)
        restarted[victim.address] = len(d.frontend.stderr_lines)

    took = send(d, calls, restart, [d.decodes[0], d.prefills[1]])
    for call in calls:
        what = f"{call.kind} {call.request_id} ({took}): {call.end} {call.details!r}"
        if call.kind == "grpc":
            assert call.end == "FINISH_REASON_LENGTH", what
            assert call.tokens == engine_greedy(call.prompt, call.max_tokens), what
        else:
            assert (call.end, call.num_tokens) == ("length", call.max_tokens), what

    # Both came back and serve: calls go to them again (more if the traffic was over first).
    def served(address: str) -> bool:
        route = re.compile(rf" done: .*(prefill|decode) {re.escape(address)}[ ,]")
        return any(route.search(line) for line in d.frontend.stderr_lines[restarted[address] :])

    for round_ in range(10):
        if all(served(address) for address in restarted):
            break
        more = [replace_id(c, f"again-{round_}-{i}") for i, c in enumerate(calls[:NUM_CALLERS])]
        with ThreadPoolExecutor(NUM_CALLERS) as callers:
            list(callers.map(lambda c: grpc_call(d, c), more))
        assert all(c.end == "FINISH_REASON_LENGTH" for c in more), more
    assert all(served(address) for address in restarted), "".join(
        d.frontend.stderr_lines[min(restarted.values()) :]
    )
    # Every block of every instance is free again (those drained restarted with fresh pools).
    totals = [d.prefill_info(i).num_total_blocks for i in range(len(d.prefills))]
    totals += [d.decode_info(i).num_total_blocks for i in range(len(d.decodes))]
    assert list(d.settled_free_blocks(timeout_s=30).values()) == totals


def replace_id(call: Call, request_id: str) -> Call:
    """`call` sent again over gRPC under another id."""
    return Call("grpc", request_id, call.prompt, call.max_tokens)
