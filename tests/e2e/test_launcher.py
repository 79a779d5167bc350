"""`mili serve`: four processes up and healthy, one generation through them, a clean SIGTERM
stop in order (frontend, then prefill/decode, then tokenizer); a child failing at start-up is
reported with its last log lines and a non-zero exit; a second signal aborts what is in flight
and exits 130; --help explains the instance counts and supervision (tests/e2e/test_supervise.py
has the restarts)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from tests.service_process import ROOT, ServiceProcess, counted


def _index(lines: list[str], text: str) -> int:
    return next(i for i, line in enumerate(lines) if text in line)


def test_serve_answers_and_stops_cleanly_on_sigterm(demo_model_dir: Path) -> None:
    serve = ServiceProcess(
        "serve",
        "--model",
        str(demo_model_dir),
        "--port",
        "0",
        "--prefill-args",
        "--num-blocks 256",
        "--decode-args",
        "--num-blocks 256",
        timeout_s=180,
    )
    try:
        with grpc.insecure_channel(serve.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            responses = list(
                stub.Generate(
                    generation_pb2.GenerateRequest(
                        prompt="Hello",
                        sampling=sampling_pb2.SamplingParams(max_tokens=8, temperature=0),
                    ),
                    timeout=60,
                )
            )
        assert responses[-1].finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED
        assert responses[-1].usage.completion_tokens >= 1
    finally:
        code = serve.terminate(timeout_s=90)
    assert code == 0, serve.stderr[-3000:]
    lines = serve.stderr_lines
    stopped = {
        name: _index(lines, f"{name}: stopped") for name in ("frontend", "prefill", "decode")
    }
    stopped["tokenizer"] = _index(lines, "tokenizer: stopped")
    assert stopped["frontend"] < stopped["prefill"] < stopped["tokenizer"]
    assert stopped["frontend"] < stopped["decode"] < stopped["tokenizer"]
    assert all(line.startswith("[") or "mili serve" in line for line in lines)


def test_serve_reports_a_child_failing_at_startup(demo_model_dir: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mili",
            "serve",
            "--model",
            str(demo_model_dir),
            "--port",
            "0",
            "--prefill-args",
            "--block-size 0",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "prefill-0 exited with code" in result.stderr
    assert "its last log lines" in result.stderr and "block_size" in result.stderr
    assert "frontend service listening" not in result.stdout


def test_attention_flag_reaches_prefill_and_decode_only(tmp_path: Path) -> None:
    import argparse

    from mili.serve.launcher import add_arguments
    from mili.serve.plan import make_plan

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plan = make_plan(parser.parse_args(["--attention", "torch"]), tmp_path)
    for argv in (*plan.prefills, *plan.decodes):
        assert argv[argv.index("--attention") + 1] == "torch"
    assert "--attention" not in plan.tokenizer and "--attention" not in plan.frontend
    default = make_plan(parser.parse_args([]), tmp_path)  # the services' own default (auto)
    assert not any("--attention" in argv for argv in (*default.prefills, *default.decodes))


def test_no_prefix_cache_reaches_prefill_and_decode_and_they_accept_it(tmp_path: Path) -> None:
    import argparse

    from mili.cli import build_parser
    from mili.serve.launcher import add_arguments
    from mili.serve.plan import make_plan

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plan = make_plan(parser.parse_args(["--no-prefix-cache"]), tmp_path)
    for argv in (*plan.prefills, *plan.decodes):
        assert "--no-prefix-cache" in argv
        assert build_parser(argv).parse_args(argv).prefix_caching is False
    assert "--no-prefix-cache" not in plan.tokenizer + plan.frontend
    default = make_plan(parser.parse_args([]), tmp_path)
    for argv in (*default.prefills, *default.decodes):
        assert build_parser(argv).parse_args(argv).prefix_caching is True


def test_a_second_signal_aborts_in_flight_calls_and_exits_non_zero(demo_model_dir: Path) -> None:
    serve = ServiceProcess(
        "serve", "--model", str(demo_model_dir), "--port", "0",
        "--prefill-args", "--num-blocks 256", "--decode-args", "--num-blocks 256",
        timeout_s=180,
    )  # fmt: skip
    outcome: list[object] = []
    first_token = threading.Event()

    def long_call() -> None:
        with grpc.insecure_channel(serve.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = generation_pb2.GenerateRequest(
                prompt="Hello",
                sampling=sampling_pb2.SamplingParams(
                    max_tokens=3000, temperature=0, ignore_eos=True
                ),
            )
            try:
                for _ in stub.Generate(request, timeout=120):
                    first_token.set()
                outcome.append("finished")
            except grpc.RpcError as err:
                outcome.append(err.code())

    caller = threading.Thread(target=long_call)
    caller.start()
    try:
        assert first_token.wait(timeout=60)
        serve.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while not any("draining; 1 call in flight" in line for line in serve.stderr_lines):
            assert time.monotonic() < deadline, serve.stderr[-3000:]
            time.sleep(0.05)
        serve.proc.send_signal(signal.SIGINT)  # the impatient operator's second Ctrl-C
        code = serve.proc.wait(timeout=90)
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()
        caller.join(timeout=60)
    assert code == 130, serve.stderr[-3000:]
    assert "mili serve: aborted" in serve.stderr
    assert outcome and outcome[0] != "finished"  # it was cut off, not drained


def test_serve_help_explains_instances_and_supervision() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mili", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # argparse wraps to the terminal width
    assert "--prefill-instances N prefill processes to run" in text
    assert "--decode-instances N decode processes to run" in text
    assert "--fail-fast a child that exits stops all the others" in text
    assert "restarted on the same address" in text


def test_several_frontends_share_one_port_and_clients_spread_over_them(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    serve = ServiceProcess(
        "serve", "--model", str(demo_model_dir), "--port", "0", "--http-port", "0",
        "--metrics-port", "0", "--frontends", "2",
        "--prefill-args", "--num-blocks 256", "--decode-args", "--num-blocks 256",
        timeout_s=180,
    )  # fmt: skip
    try:
        summary = "".join(serve.stdout_lines)
        row = r"mili serve: frontend-{}\s+(\S+) pid (\d+) http (\S+) metrics (\S+)"
        found = [re.search(row.format(k), summary) for k in (0, 1)]
        assert found[0] and found[1], summary
        (address, pid0, http, metrics0), (address1, pid1, http1, metrics1) = (
            found[0].groups(),
            found[1].groups(),
        )
        # two processes, one gRPC and one HTTP address
        assert (address1, http1) == (address, http) and pid0 != pid1, summary
        assert serve.address == address and f"API on {http}/v1" in summary
        assert summary.count("frontend service listening on") == 1
        out = tmp_path / "bench.json"
        bench = subprocess.run(
            [sys.executable, "-m", "mili", "bench", "--address", address,
             "--concurrency", "16", "--num-requests", "32", "--prompt-tokens", "8",
             "--output-tokens", "4", "--json", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert bench.returncode == 0, bench.stdout + bench.stderr
        result = json.loads(out.read_text())
        assert result["num_ok"] == 32 and result["config"]["connections"] == 16
        # 16 connections, one a client: all on one frontend with probability 2 / 2**16
        generates = [
            counted(m, "mili_requests_total", grpc_method="Generate") for m in (metrics0, metrics1)
        ]
        assert sum(generates) == 32 and min(generates) > 0, generates
        # the OpenAI SDK, a client (its own connection) per request, through the one address
        for _ in range(16):
            with openai.OpenAI(base_url=f"{http}/v1", api_key="-", max_retries=0) as client:
                reply = client.completions.create(
                    model=client.models.list().data[0].id, prompt="Hello", max_tokens=2
                )
                assert reply.choices[0].finish_reason in ("length", "stop")
        completions = [
            counted(m, "mili_http_requests_total", route="/v1/completions")
            for m in (metrics0, metrics1)
        ]
        assert sum(completions) == 16 and min(completions) > 0, completions
        # /metrics on the shared HTTP port would answer from either: it says where to look
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{http}/metrics", timeout=10)
        assert refused.value.code == 404
        assert "scrape each frontend's --metrics-port" in refused.value.read().decode()
    finally:
        code = serve.terminate(timeout_s=90)
    assert code == 0, serve.stderr[-3000:]
    lines = serve.stderr_lines
    prefill_stopped = _index(lines, "prefill: stopped")
    for k in (0, 1):  # both drain before the services they use stop
        stopped = next(
            i for i, line in enumerate(lines) if f"[frontend-{k}]" in line and "stopped" in line
        )
        assert stopped < prefill_stopped


def test_frontends_share_the_port_and_get_metrics_ports_after_the_rest(tmp_path: Path) -> None:
    import argparse

    from mili.serve.launcher import add_arguments
    from mili.serve.plan import make_plan

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = ["--frontends", "3", "--port", "6000", "--metrics-port", "7000"]
    plan = make_plan(parser.parse_args(args), tmp_path)

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    assert [flag(a, "--port") for a in plan.frontends] == ["6000", "6000", "6000"]
    assert all("--reuse-port" in a for a in plan.frontends)
    one = make_plan(parser.parse_args(["--port", "6000"]), tmp_path)
    assert "--reuse-port" not in one.frontend  # alone, a port someone holds fails its start
    # tokenizer 7001, prefill 7002, decode 7003: the extra frontends come after them
    assert [flag(a, "--metrics-port") for a in plan.frontends] == ["7000", "7004", "7005"]
    assert plan.frontend == plan.frontends[0]


def test_serve_stops_on_sigterm_after_its_output_is_gone(demo_model_dir: Path) -> None:
    """Found by an operator's pass (a `mili serve` whose reader exited): its stderr a broken
    pipe, `mili serve` ignored SIGTERM for good (the signal handler's "got SIGTERM" line raised
    BrokenPipeError before the stop began) and its children's forwarded lines stopped being
    read. Its stdout a broken pipe, the lines it prints once all are up raised BrokenPipeError
    and it exited 1, stopping every child (found by CI: the reader of the last line exited
    between that line's text and its newline). With its output gone it still serves, drains
    and exits, children and all."""
    out_read, out_write = os.pipe()
    os.close(out_read)  # every write to stdout fails: EPIPE
    read, write = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mili", "serve", "--model", str(demo_model_dir), "--port", "0"],
        stdout=out_write,
        stderr=write,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    os.close(out_write)
    os.close(write)
    try:
        seen = b""
        deadline = time.monotonic() + 180
        while b"] frontend service listening on" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen[-3000:]
            seen += os.read(read, 65536)
        time.sleep(2.0)  # the launcher's health check of the frontend, then its stdout lines
        # `mili serve` is the parent of the four services (Linux)
        family = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text()
        children = [int(pid) for pid in family.split()]
        assert len(children) == 4, (family, seen[-3000:])
    finally:
        os.close(read)  # every later write to stderr fails: EPIPE
    assert proc.poll() is None, proc.returncode  # still serving, its stdout gone
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=90)
    finally:
        proc.kill()
    assert code in (0, 120), code  # 120: Python could not flush its output at exit
    for pid in children:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"child {pid} outlived mili serve")
