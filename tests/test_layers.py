"""The layers stay apart, and the packages depend on each other in one direction.

- The engine, the bookkeeping and the frontend's generation logic never import generated
  protobuf, directly or through another MILI module. Only servicers, clients and convert modules
  (the transport edge) may.
- The bookkeeping (block pool, prefix cache, request table, scheduler, router...) imports no
  torch, grpc or opentelemetry, and neither do its tests when pytest runs them.
- No import circle between packages (see `_unit` for what a package is here).

Walks the import statements of the source (not what happens to be loaded), so a new
`from mili.x.v1 import x_pb2` anywhere below these modules fails here with the chain that
reaches it. Imports under `if TYPE_CHECKING:` do not count: they never run. Each rule has a test
showing that it can fail.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mili", "services", "kernels")

# Pure Python bookkeeping with exact ids (docs/architecture.md, "Three layers"), and its tests.
BOOKKEEPING = [
    "mili.arith",
    "mili.engine.kv.block_pool",
    "mili.engine.kv.block_hash",
    "mili.engine.kv.prefix_cache",
    "mili.engine.step.byte_ring",
    "mili.engine.constraint.spec",
    "mili.engine.constraint.schema",
    "services.decode.requests",
    "services.decode.progress",
    "services.prefill.scheduler",
    "services.frontend.router",
    "services.frontend.prefix_index",
    "services.frontend.admission",
]
BOOKKEEPING_TESTS = [
    "tests/engine/test_block_pool.py",
    "tests/engine/test_prefix_cache.py",
    "tests/decode/test_requests.py",
    "tests/prefill/test_scheduler.py",
    "tests/frontend/test_router.py",
    "tests/frontend/test_prefix_index.py",
    "tests/frontend/test_admission.py",
]
HEAVY = ("torch", "grpc", "opentelemetry")  # what bookkeeping must not import

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
    "services.frontend.admission",
    # compute loops
    "services.decode.batcher",
    "services.decode.stream",
    "services.prefill.worker",
    "services.prefill.task",
    # the frontend's generation logic
    "services.frontend.pipeline",
    "services.frontend.placement",
    "services.frontend.admitter",
    "services.frontend.prompt",
    "services.frontend.validation",
    "services.frontend.calls",
    "services.frontend.stop",
    "services.frontend.config",
]


def _path(module: str, root: Path = ROOT) -> Path | None:
    base = root.joinpath(*module.split("."))
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
def _imports(module: str, root: Path = ROOT) -> tuple[str, ...]:
    path = _path(module, root)
    if path is None:
        return ()
    return tuple(_imported(ast.parse(path.read_text(), str(path))))


def _is_generated(name: str) -> bool:
    return name.rsplit(".", 1)[-1].endswith(("_pb2", "_pb2_grpc"))


def _is_heavy(name: str) -> bool:
    return name.split(".")[0] in HEAVY


def _chain_to(module: str, is_target: Callable[[str], bool], root: Path = ROOT) -> list[str] | None:
    """The import chain from `module` to a module `is_target` accepts, or None. Importing a.b.c
    runs a/__init__.py and a/b/__init__.py too: they are on the walk."""
    seen = {module}
    queue: list[list[str]] = [[module]]
    while queue:
        chain = queue.pop(0)
        parts = chain[-1].split(".")
        parents = [".".join(parts[:i]) for i in range(1, len(parts))]
        for name in [*parents, *_imports(chain[-1], root)]:
            if is_target(name):
                return [*chain, name]
            if name.split(".")[0] in PACKAGES and _path(name, root) and name not in seen:
                seen.add(name)
                queue.append([*chain, name])
    return None


def _chain_to_protobuf(module: str) -> list[str] | None:
    """The import chain from `module` to a generated protobuf module, or None."""
    return _chain_to(module, _is_generated)


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


# ---- bookkeeping: no torch, grpc or opentelemetry ----------------------------------------------


@pytest.mark.parametrize("module", BOOKKEEPING)
def test_bookkeeping_imports_no_torch_grpc_or_opentelemetry(module: str) -> None:
    assert _path(module) is not None, f"{module} does not exist: update BOOKKEEPING"
    chain = _chain_to(module, _is_heavy)
    assert chain is None, f"{module} is bookkeeping but imports {' -> '.join(chain or [])}"


def test_the_walk_sees_torch_where_it_is(tmp_path: Path) -> None:
    # The check can fail: a bookkeeping module importing torch two modules down is caught.
    (tmp_path / "mili").mkdir()
    (tmp_path / "mili/__init__.py").write_text("")
    (tmp_path / "mili/pure.py").write_text("from mili.helper import f\n")
    (tmp_path / "mili/helper.py").write_text("def f():\n    import torch.nn\n")
    assert _chain_to("mili.pure", _is_heavy, tmp_path) == ["mili.pure", "mili.helper", "torch.nn"]
    assert _chain_to("services.decode.batcher", _is_heavy) is not None  # compute does


_RUN_TESTS = """
import sys
import pytest
code = pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[2:]])
heavy = sys.argv[1].split(",")
print("LOADED:", " ".join(n for n in heavy if n in sys.modules))
sys.exit(code)
"""


def _modules_loaded_by_tests(paths: Iterable[str], watched: Iterable[str]) -> tuple[int, list[str]]:
    """Run the test files under pytest (conftests and all) in a fresh interpreter: its exit code
    and which of `watched` it had imported by the end."""
    result = subprocess.run(
        [sys.executable, "-c", _RUN_TESTS, ",".join(watched), *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("LOADED:")]
    assert lines, result.stdout + result.stderr
    return result.returncode, lines[-1].split()[1:]


def test_bookkeeping_tests_run_without_torch_grpc_or_opentelemetry() -> None:
    # With their conftests (tests/conftest.py and each folder's): fixtures import torch lazily.
    code, loaded = _modules_loaded_by_tests(BOOKKEEPING_TESTS, HEAVY)
    assert code == 0
    assert loaded == [], f"running the bookkeeping tests imported {loaded}"


def test_the_test_run_sees_what_tests_import(tmp_path: Path) -> None:
    # The check can fail: a test that imports grpc is seen (grpc: cheaper to import than torch).
    test = tmp_path / "test_heavy.py"
    test.write_text("import grpc\n\n\ndef test_it():\n    assert grpc\n")
    code, loaded = _modules_loaded_by_tests([str(test)], HEAVY)
    assert (code, loaded) == (0, ["grpc"])


# ---- no import circle between packages ---------------------------------------------------------


def _modules(root: Path = ROOT) -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join(parts))
    return names


def _unit(module: str, root: Path = ROOT) -> str:
    """The package `module` belongs to, for the no-circle rule: its subpackage (mili.rpc,
    mili.engine.kv, services.decode, kernels.fused, mili.pb.decode.v1...), whose modules may import
    each other freely; a module directly in a folder that holds subpackages (mili/, kernels/,
    services/, mili/engine/) is a unit of its own. Such folders hold independent pieces
    (mili.errors, used by everything, and mili.cli, which uses everything; kernels.build and
    kernels.ptx; mili.engine.engine_config and mili.engine.generate), not one package: taken as
    one, mili would be a circle with every subpackage by construction."""
    path = _path(module, root)
    package = (
        module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]
    )
    if not package:
        return module
    folder = root / package.replace(".", "/")
    has_subpackages = any((child / "__init__.py").exists() for child in folder.iterdir())
    return module if has_subpackages else package


def _package_graph(root: Path = ROOT) -> dict[str, dict[str, tuple[str, str]]]:
    """unit -> {unit it imports: one (importing module, imported module) that says so}."""
    modules = set(_modules(root))
    graph: dict[str, dict[str, tuple[str, str]]] = {}
    for module in sorted(modules):
        source = _unit(module, root)
        arrows = graph.setdefault(source, {})
        for name in _imports(module, root):
            if name in modules and (target := _unit(name, root)) != source:
                arrows.setdefault(target, (module, name))
    return graph


def _find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One circle of `graph` as [a, b, ..., a], or None when it has none (depth-first search)."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph.get(node, ())):
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target not in done and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_circle_between_packages() -> None:
    graph = _package_graph()
    cycle = _find_cycle(graph)
    if cycle is not None:
        arrows = [f"{a} -> {b} ({' imports '.join(graph[a][b])})" for a, b in pairwise(cycle)]
        pytest.fail("import circle between packages:\n  " + "\n  ".join(arrows))


def test_the_cycle_finder_finds_circles() -> None:
    # The check can fail: on a small graph, and on ours with one arrow more.
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert _find_cycle({"a": {"a"}}) == ["a", "a"]
    graph = {unit: set(arrows) for unit, arrows in _package_graph().items()}
    assert "mili.engine.step" in graph["services.decode"]
    graph["mili.engine.step"].add("services.decode")
    cycle = _find_cycle(graph)
    assert cycle is not None and {"mili.engine.step", "services.decode"} <= set(cycle)


def test_units_are_subpackages_or_top_level_modules() -> None:
    assert _unit("mili.engine.kv.block_pool") == _unit("mili.engine.kv") == "mili.engine.kv"
    assert _unit("mili.engine.engine_config") == "mili.engine.engine_config"
    assert _unit("services.decode.requests") == "services.decode"
    assert _unit("kernels.fused.ptx") == "kernels.fused"
    assert _unit("mili.pb.decode.v1.decode_pb2") == "mili.pb.decode.v1"
    assert (_unit("mili.errors"), _unit("kernels.build"), _unit("mili")) == (
        "mili.errors",
        "kernels.build",
        "mili",
    )
