"""Hardening from a break-test, on the whole pipeline as real processes: undecodable bytes sent
to every method of every service are INVALID_ARGUMENT with one WARNING line each (no
traceback, nothing from grpc at ERROR); a client's request id cannot forge a log line; a
prompt far over every limit is refused before the frontend holds it."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.decode.v1 import decode_pb2
from mili.pb.frontend.v1 import generation_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.pb.prefill.v1 import prefill_pb2
from mili.pb.tokenizer.v1 import tokenizer_pb2
from tests.e2e.conftest import Deployment
from tests.service_process import ServiceProcess

GARBAGE = b"\xff\xff\xff\xff"  # no message parses this: a truncated field number


def _wait_for_lines(service: ServiceProcess, start: int, text: str, count: int) -> list[str]:
    """service's log lines from `start` on, once `count` of them contain `text` (or 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        lines = service.stderr_lines[start:]
        if sum(text in line for line in lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def _send_garbage(channel: grpc.Channel, path: str, method: Any) -> tuple[grpc.StatusCode, str]:
    """Call `path` with one GARBAGE message, as a unary request or as a stream of one."""

    def one() -> Iterator[bytes]:
        yield GARBAGE

    try:
        if method.client_streaming and method.server_streaming:
            list(channel.stream_stream(path)(one(), timeout=10))
        elif method.client_streaming:
            channel.stream_unary(path)(one(), timeout=10)
        elif method.server_streaming:
            list(channel.unary_stream(path)(GARBAGE, timeout=10))
        else:
            channel.unary_unary(path)(GARBAGE, timeout=10)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    raise AssertionError(f"{path} accepted {GARBAGE!r}")


def test_every_method_refuses_malformed_bytes_with_one_warning(pipeline: Deployment) -> None:
    processes = {
        "frontend": pipeline.frontend,
        "tokenizer": pipeline.tokenizer,
        "prefill": pipeline.prefills[0],
        "decode": pipeline.decodes[0],
    }
    services = [
        ("frontend", generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]),
        ("tokenizer", tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"]),
        ("prefill", prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"]),
        ("decode", decode_pb2.DESCRIPTOR.services_by_name["DecodeService"]),
        ("decode", kv_pb2.DESCRIPTOR.services_by_name["KvTransferService"]),
    ]
    starts = {name: len(p.stderr_lines) for name, p in processes.items()}
    sent: dict[str, list[str]] = {name: [] for name in processes}
    for name, service in services:
        with grpc.insecure_channel(processes[name].address) as channel:
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                code, details = _send_garbage(channel, path, method)
                assert code is grpc.StatusCode.INVALID_ARGUMENT, (path, code, details)
                assert details.startswith(f"malformed request to {path}: "), details
                sent[name].append(path)
    # every method of every service (13, plus GenerateStream, GetTokenizerFile and Pair)
    assert sum(len(paths) for paths in sent.values()) == 16
    for name, paths in sent.items():
        lines = _wait_for_lines(processes[name], starts[name], "malformed request to", len(paths))
        warnings = [line for line in lines if "malformed request to" in line]
        assert len(warnings) == len(paths), warnings
        for path, line in zip(paths, warnings, strict=True):
            assert f" WARNING mili.rpc: {name}: malformed request to {path} from " in line
        assert not [line for line in lines if " ERROR " in line or "Traceback" in line], lines


# A request id that, written raw, would end its log line, forge one at ERROR, return the
# carriage, color the terminal and break the line again for viewers that honour U+2028.
FORGED = "id\n2026-01-01 00:00:00,000 ERROR mili.frontend: FORGED\r\x1b[31mred\x1b[0m\u2028end"
FORGED_ESCAPED = (
    "id\\n2026-01-01 00:00:00,000 ERROR mili.frontend: FORGED\\r\\x1b[31mred\\x1b[0m\\u2028end"
)


def test_client_strings_cannot_forge_log_lines(pipeline: Deployment) -> None:
    frontend = pipeline.frontend
    start = len(frontend.stderr_lines)
    stub = pipeline.stub()
    sampling = sampling_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    # One request that finishes (its "done" line) and one that fails once tokenized (its
    # "failed" line); the prompt carries control characters too.
    done = generation_pb2.GenerateRequest(
        request_id=f"{FORGED}-ok", prompt="hi\n\x1b[2J\r", sampling=sampling
    )
    assert list(stub.Generate(done, timeout=60))[-1].usage.completion_tokens == 2
    failed = generation_pb2.GenerateRequest(
        request_id=f"{FORGED}-bad", token_ids=[1, 10**9], sampling=sampling
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(failed, timeout=60))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    lines = _wait_for_lines(frontend, start, FORGED_ESCAPED, 2)
    # Exactly one line per logged event, the id escaped in it; no stray piece of it anywhere.
    for suffix, event in (("ok", " done: "), ("bad", " failed after ")):
        logged = [line for line in lines if f"{FORGED_ESCAPED}-{suffix}' (id " in line]
        assert len(logged) == 1 and event in logged[0], lines
    assert [line for line in lines if "FORGED" in line and FORGED_ESCAPED not in line] == []
    assert not [line for line in lines if "\x1b" in line or "\u2028" in line or "\r" in line]


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024  # "VmRSS:   123456 kB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_60_mb_prompt_is_refused_at_once_and_leaves_the_frontend_rss_alone(
    pipeline: Deployment,
) -> None:
    """60 MB: under grpc's old 64 MiB default, 60 times the tokenizer's 1 M characters."""
    pid = pipeline.frontend.proc.pid
    stub = pipeline.stub()
    request = generation_pb2.GenerateRequest(
        prompt="x" * 60_000_000, sampling=sampling_pb2.SamplingParams(max_tokens=1)
    )
    list(stub.Generate(generation_pb2.GenerateRequest(prompt="warm up"), timeout=60))
    before = _rss_bytes(pid)
    started = time.monotonic()
    for _ in range(10):
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=60))
        code, details = caught.value.code(), caught.value.details() or ""
        assert code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
        assert "larger than max" in details or "limit" in details, details
    elapsed_s = time.monotonic() - started
    grown = _rss_bytes(pid) - before
    print(
        f"10 x 60 MB prompts: refused in {elapsed_s:.2f} s, frontend RSS {before / 2**20:.0f} "
        f"MiB -> {(before + grown) / 2**20:.0f} MiB"
    )
    assert grown < 32 * 2**20, f"the frontend grew by {grown / 2**20:.0f} MiB"
    assert elapsed_s < 30, f"10 refusals took {elapsed_s:.1f} s"  # mostly our own 60 MB copies


def test_the_largest_valid_prompt_is_not_refused_for_its_size(pipeline: Deployment) -> None:
    """1 M characters (the tokenizer's limit) of 4-byte UTF-8: the frontend reads it, the
    tokenizer tokenizes it, and the request fails only for what it is: far more prompt tokens
    than the demo deployment takes."""
    prompt = "\U0001f600" * 1_000_000
    assert len(prompt.encode()) == 4_000_000
    request = generation_pb2.GenerateRequest(
        prompt=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=1)
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(pipeline.stub().Generate(request, timeout=120))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    details = caught.value.details() or ""
    assert "this model's maximum context length is" in details, details
    assert details.endswith("(got 3000000 tokens)"), details


def test_text_over_the_tokenizers_limit_is_refused_by_the_frontend(pipeline: Deployment) -> None:
    """Under the message limit but over the tokenizer's 1 M characters: the frontend knows the
    limit from the tokenizer's Info and refuses the prompt without forwarding it."""
    tokenizer_lines = len(pipeline.tokenizer.stderr_lines)
    request = generation_pb2.GenerateRequest(
        prompt="x" * 1_000_001, sampling=sampling_pb2.SamplingParams(max_tokens=1)
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(pipeline.stub().Generate(request, timeout=60))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    details = caught.value.details() or ""
    assert "prompt: longer than the tokenizer's limit of 1000000 characters" in details, details
    assert len(pipeline.tokenizer.stderr_lines) == tokenizer_lines  # nothing reached it
