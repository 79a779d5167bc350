"""`mili generate` and `mili bench` against a running deployment, as an operator runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import Deployment
from tests.service_process import ROOT


def mili(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mili", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_streams_text_and_reports_usage(pipeline: Deployment) -> None:
    result = mili(
        "generate", "Hello", "--address", pipeline.frontend.address, "--max-tokens", "8",
        "--temperature", "0", "--ignore-eos",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout  # the text (8 tokens of the demo model: some characters)
    assert "[finish: length; prompt tokens" in result.stderr
    assert "completion tokens 8" in result.stderr


def test_generate_chat_with_stop(pipeline: Deployment) -> None:
    result = mili(
        "generate", "Hi", "--chat", "--system", "Be brief.", "--no-thinking", "--address",
        pipeline.frontend.address, "--max-tokens", "16", "--temperature", "0", "--stop", "\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "\n" not in result.stdout  # cut before the stop string (no newline added: not a tty)
    assert "[finish: " in result.stderr


def test_generate_error_is_one_line_with_the_code(pipeline: Deployment) -> None:
    result = mili("generate", "Hi", "--address", pipeline.frontend.address, "--top-p", "2")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "mili generate: INVALID_ARGUMENT: sampling.top_p: must be in (0, 1] (got 2.0)"
    ]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-tokens", "2147483648"),
        ("--seed", str(2**64)),
        ("--top-k", "-1"),
        ("--timeout", "inf"),
    ],
)
def test_generate_refuses_a_value_its_request_cannot_carry(flag: str, value: str) -> None:
    """Found by a flag review: past the proto's ranges the request could not be built (a
    ValueError traceback); a timeout of inf overflowed grpc's deadline (DEADLINE_EXCEEDED)."""
    result = mili("generate", "Hi", "--address", "127.0.0.1:1", flag, value)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"mili generate: error: {flag} must be in ")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--output-tokens", "2147483648"), "--output-tokens"),
        (("--timeout", "inf"), "--timeout"),
        (("--json", "/"), "--json"),
        (("--json", "/no/such/dir/out.json"), "--json"),
    ],
)
def test_bench_refuses_what_would_fail_every_request_or_lose_the_results(
    flags: tuple[str, ...], named: str
) -> None:
    """Found by a flag review: a --json path that cannot be written failed after the whole
    run (its results lost); the others failed every request."""
    result = mili("bench", "--address", "127.0.0.1:1", *flags)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"mili bench: error: {named}")


def test_generate_unreachable_frontend_is_unavailable() -> None:
    result = mili("generate", "Hi", "--address", "127.0.0.1:1", "--timeout", "5")
    assert result.returncode == 1
    assert result.stderr.startswith("mili generate: UNAVAILABLE")


def test_bench_reports_latencies_and_writes_json(pipeline: Deployment, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = mili(
        "bench", "--address", pipeline.frontend.address, "--concurrency", "3",
        "--num-requests", "6", "--prompt-tokens", "24", "--output-tokens", "8",
        "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ttft" in result.stdout and "itl" in result.stdout
    summary = json.loads(out.read_text())
    assert summary["num_ok"] == 6 and summary["num_errors"] == 0
    assert summary["output_tokens_per_s"] > 0
    for name in ("ttft", "itl"):
        stats = summary[name]
        assert 0 < stats["p50_ms"] <= stats["p90_ms"] <= stats["p99_ms"] <= stats["max_ms"]
    assert summary["kv_transfer_gbps"] is None and summary["kv_transfer_note"]


def test_bench_splits_its_clients_over_processes(pipeline: Deployment, tmp_path: Path) -> None:
    """`mili bench --processes 2`, as typed: the clients run in two spawned processes, the
    report has both processes' CPU, and every request ran once (greedy: the same tokens a
    single process gets)."""
    out = tmp_path / "bench.json"
    result = mili(
        "bench", "--address", pipeline.frontend.address, "--concurrency", "3",
        "--num-requests", "6", "--prompt-tokens", "24", "--output-tokens", "8",
        "--processes", "2", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "client     2 processes, " in result.stdout
    assert "mili bench: 6/6 done, 0 errors," in result.stderr
    summary = json.loads(out.read_text())
    assert (summary["num_ok"], summary["num_errors"]) == (6, 0)
    assert summary["config"]["processes"] == 2 and len(summary["client_cpu_percent"]) == 2
    assert summary["output_tokens_per_s"] == pytest.approx(48 / summary["wall_s"])
    assert 0 < summary["ttft"]["p50_ms"] <= summary["ttft"]["p99_ms"]


def test_generate_finish_line_is_a_line_of_its_own_in_a_shared_stream(
    pipeline: Deployment,
) -> None:
    args = ("generate", "Hello", "--address", pipeline.frontend.address, "--max-tokens", "8",
            "--temperature", "0", "--ignore-eos")  # fmt: skip
    text = mili(*args).stdout
    assert text and not text.endswith("\n")  # the case that glued `[finish: ...]` to it
    shared = subprocess.run(
        [sys.executable, "-m", "mili", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # `mili generate ... 2>&1 | less`
        text=True,
        timeout=120,
    )
    assert shared.returncode == 0, shared.stdout
    assert shared.stdout.startswith(text + "\n[finish: length; prompt tokens")
    assert shared.stdout.count("\n") == 2


def test_bench_shows_progress_and_counts_each_error(pipeline: Deployment, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = mili(
        "bench", "--address", pipeline.frontend.address, "--concurrency", "2",
        "--num-requests", "4", "--prompt-tokens", "5000", "--output-tokens", "8",
        "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 1
    progress = [line for line in result.stderr.splitlines() if line.startswith("mili bench: ")]
    assert progress and progress[-1].startswith("mili bench: 4/4 done, 4 errors,")
    summary = json.loads(out.read_text())
    assert summary["num_errors"] == 4
    [group] = summary["errors"]  # one failure mode, however many requests hit it
    assert group["count"] == 4 and group["error"].startswith("INVALID_ARGUMENT")
    assert f"error      4 x {group['error']}" in result.stdout


def test_bench_groups_errors_by_cause_not_by_request(pipeline: Deployment, tmp_path: Path) -> None:
    """Found by an operator's pass: errors were grouped by their exact message, so a run whose
    requests all failed for one cause printed a group per request when the message named the
    request's own token ids (here: prompt ids drawn past the demo model's vocabulary, a field
    violation per bad id, a different number of them per request). One cause is one group,
    its count and one example as the frontend said it."""
    from mili.client.bench_report import MAX_SHOWN_CHARS

    out = tmp_path / "bench.json"
    result = mili(
        "bench", "--address", pipeline.frontend.address, "--concurrency", "4",
        "--num-requests", "24", "--prompt-tokens", "6", "--output-tokens", "2",
        "--token-id-range", "700:1400", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    summary = json.loads(out.read_text())
    examples = [g["error"] for g in summary["errors"]]
    assert summary["num_errors"] >= 20, summary  # (some prompts may draw only in-vocab ids)
    [group] = summary["errors"]
    assert group["count"] == summary["num_errors"], examples
    assert group["cause"] == (
        "INVALID_ARGUMENT: token_ids[#]: outside the vocabulary (ids #..#) (got #)"
    )
    assert group["error"].startswith("INVALID_ARGUMENT: token_ids[")  # as it was sent
    assert "(got " in group["error"] and "#" not in group["error"]
    [line] = [x for x in result.stdout.splitlines() if x.startswith("error ")]
    assert line.startswith(f"error      {group['count']} x {group['error'][:MAX_SHOWN_CHARS]}")


def test_bench_errors_group_by_cause_with_ids_and_numbers_masked() -> None:
    from mili.client.bench_report import group_errors

    errors = [
        "UNAVAILABLE: decode at 127.0.0.1:1 is down",
        "DEADLINE_EXCEEDED: request bench-3 timed out",
        "UNAVAILABLE: decode at 127.0.0.1:1 is down",
        "UNAVAILABLE: decode at 127.0.0.1:2 is down",  # another instance: another cause
        "DEADLINE_EXCEEDED: request bench-12 timed out",
        "DEADLINE_EXCEEDED: request bench-7 timed out",
        "DATA_LOSS: KV transfer of request 'bench-4' (id 3f9a0c1b2d4e-17) failed",
        "DATA_LOSS: KV transfer of request 'bench-9' (id 3f9a0c1b2d4e-22.1) failed",
    ]
    assert group_errors(errors) == [
        {
            "cause": "DEADLINE_EXCEEDED: request bench-# timed out",
            "count": 3,
            "error": "DEADLINE_EXCEEDED: request bench-3 timed out",
        },
        {
            "cause": "DATA_LOSS: KV transfer of request 'bench-#' (id *) failed",
            "count": 2,
            "error": "DATA_LOSS: KV transfer of request 'bench-4' (id 3f9a0c1b2d4e-17) failed",
        },
        {
            "cause": "UNAVAILABLE: decode at 127.0.0.1:1 is down",
            "count": 2,
            "error": "UNAVAILABLE: decode at 127.0.0.1:1 is down",
        },
        {
            "cause": "UNAVAILABLE: decode at 127.0.0.1:2 is down",
            "count": 1,
            "error": "UNAVAILABLE: decode at 127.0.0.1:2 is down",
        },
    ]


def test_bench_keeps_the_address_in_grpcs_own_connection_errors() -> None:
    """mili bench against mili serve on the demo model, its frontend killed mid-run: 230
    requests failed with gRPC's 'ipv4:127.0.0.1:47130: ... Connection refused', grouped as
    'ipv4:127.#.#.#:#' (the host:port rule took 'ipv4:127' for an address and the rest was
    numbers), so with --address A,B the two frontends' failures were one cause."""
    from mili.client.bench_report import cause

    def refused(address: str) -> str:
        return (
            "UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: "
            f"{address}: Failed to connect to remote host: Connection refused"
        )

    for address in ["ipv4:127.0.0.1:47130", "ipv6:%5B::1%5D:47130", "ipv6:[::1]:47130"]:
        assert cause(refused(address)) == refused(address)
    assert cause(refused("ipv4:127.0.0.1:47130")) != cause(refused("ipv4:127.0.0.1:47131"))


def test_the_report_shows_a_bounded_number_of_error_lines() -> None:
    """However many causes, the report prints the largest few, each example cut short, and one
    line for the rest; the JSON keeps every group whole."""
    from mili.client.bench_report import MAX_SHOWN_CHARS, MAX_SHOWN_GROUPS, _error_lines

    long = "INTERNAL: " + "x" * 1000
    groups = [{"cause": long, "count": 50, "error": long}] + [
        {"cause": f"UNKNOWN: failure mode {chr(97 + k)}", "count": 2, "error": "UNKNOWN: …"}
        for k in range(MAX_SHOWN_GROUPS + 4)
    ]
    lines = _error_lines(groups)
    assert len(lines) == MAX_SHOWN_GROUPS + 1
    assert lines[0] == f"error      50 x {long[:MAX_SHOWN_CHARS]}... (1010 characters)"
    assert lines[-1] == "error      5 more causes (10 requests); --json lists every one"


def test_generate_chat_puts_the_thinking_on_stderr_and_the_answer_on_stdout() -> None:
    """A thinking model's reasoning (here a scripted decode behind a real frontend: the demo
    model's random weights never write <think>) goes to stderr, so it is seen and stdout stays
    the answer; before, it was dropped, and a generation cut while thinking printed nothing."""
    import asyncio

    from tests.frontend.fakes import FakeDecode, ids, stack

    async def main() -> tuple[int, str, str]:
        script = [ids("<think>Plan"), ids(" it.</think>Hi"), ids(" there")]  # ids: no "\n"
        async with stack([FakeDecode(script=script)]) as s:
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mili", "generate", "Hello", "--chat",
                "--address", s.frontend.address, "--max-tokens", "100",
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            out, err = await asyncio.wait_for(child.communicate(), 60)
            return child.returncode or 0, out.decode(), err.decode()

    code, out, err = asyncio.run(main())
    assert code == 0, err
    assert out == "Hi there"
    assert err.startswith("Plan it.\n[finish: "), err


class _BrokenMidStream(generation_pb2_grpc.GenerationServiceServicer):
    """Streams one piece of text, then fails as a frontend whose decode died does."""

    def Generate(self, request: object, context: grpc.ServicerContext) -> Iterator[object]:
        yield generation_pb2.GenerateResponse(text="Hel")
        context.abort(
            grpc.StatusCode.UNAVAILABLE, "decode at 127.0.0.1:1: UNAVAILABLE: Socket closed"
        )


def test_generate_gives_no_connection_hint_once_the_stream_had_answered() -> None:
    """ "Socket closed" after text came is a peer going away, not a refused TLS handshake: the
    hint ("does it require TLS? pass --tls-ca") misled there."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(_BrokenMidStream(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        result = mili("generate", "Hi", "--address", f"127.0.0.1:{port}", "--timeout", "30")
    finally:
        server.stop(0)
    assert result.returncode == 1 and result.stdout == "Hel"
    assert result.stderr.strip().splitlines()[-1] == (
        "mili generate: UNAVAILABLE: decode at 127.0.0.1:1: UNAVAILABLE: Socket closed"
    )


def test_generate_stops_quietly_once_its_reader_is_gone(pipeline: Deployment) -> None:
    """`mili generate "..." | head -c 100`: the text's reader exited, and `mili generate`
    printed a BrokenPipeError traceback. It stops as a tool that SIGPIPE ends: no traceback,
    exit 1."""
    read, write = os.pipe()
    os.close(read)  # every write to stdout fails: EPIPE
    result = subprocess.run(
        [sys.executable, "-m", "mili", "generate", "Hello", "--address", pipeline.frontend.address,
         "--max-tokens", "64", "--temperature", "0", "--ignore-eos"],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )  # fmt: skip
    os.close(write)
    assert (result.returncode, result.stderr) == (1, "")
