"""The frontend and tokenizer processes never load torch (~2 s and ~300 MB they do not need).

Both only move control messages and text; the one thing the frontend knows about KV is the
layout it compares (mili.rpc.kv_layout, torch-free). A module that drags torch back in fails
here, naming the chain of imports, rather than as a slower start-up nobody notices.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from tests.service_process import ROOT, ServiceProcess

# Runs `mili ARGS...` as `python -m mili` does, and on the way out (after the SIGTERM drain)
# reports whether torch was ever imported.
_REPORT_TORCH = """\
import atexit, sys
atexit.register(
    lambda: print("torch in sys.modules:", "torch" in sys.modules, file=sys.stderr, flush=True)
)
from mili.cli import main
sys.exit(main(sys.argv[1:]))
"""

# Imports a module and fails naming who imported torch (python -X importtime shows the chain).
_IMPORT_AND_CHECK = """\
import sys
import {module}
assert "torch" not in sys.modules, "{module} imported torch"
"""


@pytest.mark.parametrize(
    "module",
    [
        "mili.cli",
        "services.frontend.__main__",
        "services.frontend.backends",
        "services.frontend.server",
        "services.tokenizer.__main__",
        "mili.rpc.kv_layout",
        "mili.engine.kv.kv_layout",
        "services.decode.config",  # every service's flags are built by `mili --help`
        "services.prefill.__main__",
    ],
)
def test_module_imports_without_torch(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", _IMPORT_AND_CHECK.format(module=module)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        pytest.fail(f"{module} imports torch via {' <- '.join(_chain_to_torch(result.stderr))}")


def _chain_to_torch(importtime: str) -> list[str]:
    """torch and the modules that imported it, innermost first, from `-X importtime` output.

    That output lists a module after everything it imported, indented by depth:
    `import time: self | cumulative |   name`; each ancestor is the next line less indented.
    """
    names = [line.rsplit("|", 1)[1] for line in importtime.splitlines() if line.count("|") == 2]
    start = next((i for i, name in enumerate(names) if name.strip() == "torch"), None)
    if start is None:
        return [importtime[-2000:]]  # failed for another reason: show what it printed
    chain, depth = [], len(names[start]) - len(names[start].lstrip())
    for name in names[start:]:
        indent = len(name) - len(name.lstrip())
        if indent <= depth:
            chain.append(name.strip())
            depth = indent - 1
    return chain


def _served_without_torch(service: ServiceProcess) -> None:
    # An answered call means serve_forever got past the announcement and handles SIGTERM.
    try:
        with grpc.insecure_channel(service.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        # A frontend with no reachable backends answers NOT_SERVING: an answer is what counts.
        answered = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        assert reply.status in answered
    except BaseException:
        service.proc.kill()  # a failed check must not leave the process behind
        raise
    assert service.terminate() == 0, service.stderr
    assert "torch in sys.modules: False" in service.stderr, service.stderr[-3000:]


def test_frontend_process_never_loads_torch() -> None:
    service = ServiceProcess(
        "serve-frontend", "--port", "0", "--tokenizer", "127.0.0.1:1", "--prefill",
        "127.0.0.1:2", "--decode", "127.0.0.1:3", "--poll-interval", "0.2",
        python_args=("-c", _REPORT_TORCH),
    )  # fmt: skip
    try:
        # One request through the whole handler: nothing downstream answers, so it fails, but
        # any import deferred to the first request has run by then.
        with grpc.insecure_channel(service.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.RpcError):
                list(stub.Generate(generation_pb2.GenerateRequest(prompt="hi"), timeout=10))
    finally:
        _served_without_torch(service)


def test_tokenizer_process_never_loads_torch(demo_model_dir: Path) -> None:
    service = ServiceProcess(
        "serve-tokenizer", "--model", str(demo_model_dir), "--port", "0",
        python_args=("-c", _REPORT_TORCH),
    )  # fmt: skip
    _served_without_torch(service)
