"""The three layers stay apart: the engine, the bookkeeping and the frontend's generation logic
never import generated protobuf, directly or through another MILI module. Only servicers,
clients and convert modules (the transport edge) may.

Walks the import statements of the source (not what happens to be loaded), so a new
`from mili.x.v1 import x_pb2` anywhere below these modules fails here with the chain that
reaches it. Imports under `if TYPE_CHECKING:` do not count: they never run.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mili", "services", "kernels")

# Pure logic: no protobuf below any of these.
CHECKED = [
    # the engine (model, cache, sampler, generate) and its domain types
    *sorted(
        f"mili.engine.{p.stem}" for p in (ROOT / "mili/engine").glob("*.py") if p.stem != "__init__"
    ),
    # the KV hand-off's pure parts: the choice, the checksums, the pools it maps
    "mili.kv_handoff.kv_transport",
    "mili.kv_handoff.checksums",
    "mili.kv_handoff.shm_segment",
    "mili.kv_handoff.block_rows",
    "mili.kv_handoff.cuda_ipc",
    # bookkeeping
    "services.decode.requests",
    "services.decode.progress",
    "services.prefill.scheduler",
    "services.frontend.router",
    # compute loops
    "services.decode.batcher",
    "services.decode.stream",
    "services.prefill.worker",
    "services.prefill.task",
    # the frontend's generation logic
    "services.frontend.pipeline",
    "services.frontend.prompt",
    "services.frontend.validation",
    "services.frontend.calls",
    "services.frontend.stop",
    "services.frontend.config",
]


def _path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST) -> list[str]:
    """Module names imported by statements that run (a `from a import b` names a.b as well as
    a: b may be a submodule)."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


@cache
def _imports(module: str) -> tuple[str, ...]:
    path = _path(module)
    if path is None:
        return ()
    return tuple(_imported(ast.parse(path.read_text(), str(path))))


def _is_generated(name: str) -> bool:
    return name.rsplit(".", 1)[-1].endswith(("_pb2", "_pb2_grpc"))


def _chain_to_protobuf(module: str) -> list[str] | None:
    """The import chain from `module` to a generated protobuf module, or None."""
    seen = {module}
    queue: list[list[str]] = [[module]]
    while queue:
        chain = queue.pop(0)
        for name in _imports(chain[-1]):
            if _is_generated(name):
                return [*chain, name]
            if name.split(".")[0] in PACKAGES and _path(name) and name not in seen:
                seen.add(name)
                queue.append([*chain, name])
    return None


@pytest.mark.parametrize("module", CHECKED)
def test_no_protobuf_below(module: str) -> None:
    assert _path(module) is not None, f"{module} does not exist: update CHECKED"
    chain = _chain_to_protobuf(module)
    assert chain is None, f"{module} reaches generated protobuf: {' -> '.join(chain or [])}"


def test_the_walk_sees_protobuf_where_it_is() -> None:
    # The check can fail: the transport edge does import generated modules.
    assert _chain_to_protobuf("services.frontend.convert") is not None
    assert _chain_to_protobuf("mili.kv_handoff.transport") is not None
    assert _chain_to_protobuf("services.decode.server") is not None
    chain = _chain_to_protobuf("services.frontend.server")
    assert chain is not None and _is_generated(chain[-1])
