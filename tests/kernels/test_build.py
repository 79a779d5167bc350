"""Kernel builds: keyed by the source hash, cached, and failing with one clear error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import build

ROOT = Path(__file__).resolve().parents[2]


def _copy_sources(tmp_path: Path) -> Path:
    source_dir = tmp_path / "mojo"
    shutil.copytree(build.SOURCE_DIR, source_dir)
    return source_dir


def test_source_key_follows_every_source_file(tmp_path: Path) -> None:
    source_dir = _copy_sources(tmp_path)
    key = build.source_key(source_dir)
    assert key == build.source_key(build.SOURCE_DIR)  # same bytes, same key
    for path in build.sources(source_dir):
        original = path.read_bytes()
        path.write_bytes(original + b"\n# edited\n")
        assert build.source_key(source_dir) != key, f"editing {path.name} must change the key"
        path.write_bytes(original)
    assert build.source_key(source_dir) == key
    (source_dir / "extra.mojo").write_text("def helper() -> Int:\n    return 1\n")
    assert build.source_key(source_dir) != key


def test_build_is_cached_per_source_key() -> None:
    first = build.build_cpu()
    mtime = first.stat().st_mtime_ns
    again = build.build_cpu()
    assert again == first and again.stat().st_mtime_ns == mtime
    assert first.parent.parent.name == build.source_key()
    assert first.name == "mili_attention.so"


def test_compiler_error_is_one_clear_error(tmp_path: Path) -> None:
    source_dir = _copy_sources(tmp_path)
    # Mojo compiles only what is reachable from the module's exports, so break an export.
    broken = source_dir / "mili_attention.mojo"
    export = '\n\n@export\ndef broken() abi("C") -> Int:\n    return undefined_name\n'
    broken.write_text(broken.read_text() + export)
    with pytest.raises(build.KernelBuildError) as info:
        build.build_cpu(tmp_path / "cache", source_dir=source_dir)
    message = str(info.value)
    assert message.startswith("compiling the CPU attention kernels failed (exit")
    assert "mili_attention.mojo" in message and "undefined_name" in message
    assert "Crashpad" not in message
    # Nothing half-built is left where a later build would take it for a result.
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_missing_toolchain_is_one_clear_error(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(build.KernelBuildError, match="cannot run the Mojo compiler"):
        build.build_cpu(tmp_path, mojo=tmp_path / "no-such-mojo")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(build.KernelBuildError, match="Mojo toolchain not found"):
        build.find_mojo()


def test_kernels_build_command_prints_the_module(tmp_path: Path, capsys) -> None:
    from mili.cli import main

    # The default cache is already built by the session (make test prebuilds it): no compile.
    assert main(["kernels", "build"]) == 0
    out = capsys.readouterr().out
    assert f"cpu: {build.build_cpu()}" in out
    assert f"kernels for source {build.source_key()} ready" in out


def test_kernels_build_command_reports_a_broken_toolchain(tmp_path: Path, monkeypatch, capsys):
    from mili.cli import main

    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["kernels", "build", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mili kernels: error: Mojo toolchain not found")


def test_loading_the_module_leaves_child_processes_environment_alone() -> None:
    # Mojo's runtime setenv()s PYTHONEXECUTABLE & co. when the module loads; a child that
    # inherited them would run outside our venv (e.g. the `mojo` compiler's own entry point).
    script = f"""
import json, os, subprocess, sys
from pathlib import Path
from kernels.cpu import load_module
before = dict(os.environ)
load_module(Path({str(build.build_cpu())!r}))
child = subprocess.run(["env", "-0"], capture_output=True, check=True).stdout.decode()
seen = dict(item.split("=", 1) for item in child.split("\\0") if item)
mojo = subprocess.run([{str(build.find_mojo())!r}, "--version"], capture_output=True, text=True)
print(json.dumps({{
    "changed": sorted(k for k in set(before) | set(seen) if before.get(k) != seen.get(k)),
    "mojo": [mojo.returncode, mojo.stdout + mojo.stderr],
}}))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["changed"] == []
    assert report["mojo"][0] == 0 and report["mojo"][1].startswith("Mojo "), report["mojo"]
