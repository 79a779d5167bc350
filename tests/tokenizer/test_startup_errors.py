"""A bad model directory stops the process with one clear line, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _start(model: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "mili", "serve-tokenizer"),
            *("--model", str(model), "--port", "0", *flags),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_missing_tokenizer_json(demo_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "no-tokenizer"
    shutil.copytree(demo_model_dir, model)
    (model / "tokenizer.json").unlink()
    line = _one_line_error(_start(model))
    assert "tokenizer.json" in line and str(model) in line


@pytest.mark.parametrize("content", ["{ not json", '{"model": {"type": "Nope"}}', ""])
def test_corrupt_tokenizer_json(demo_model_dir: Path, tmp_path: Path, content: str) -> None:
    model = tmp_path / "corrupt"
    shutil.copytree(demo_model_dir, model)
    (model / "tokenizer.json").write_text(content)
    line = _one_line_error(_start(model))
    assert str(model / "tokenizer.json") in line and "not a valid tokenizer" in line


def test_missing_directory(tmp_path: Path) -> None:
    line = _one_line_error(_start(tmp_path / "nowhere"))
    assert "does not exist" in line and "nowhere" in line


def test_corrupt_tokenizer_config(demo_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "bad-config"
    shutil.copytree(demo_model_dir, model)
    (model / "tokenizer_config.json").write_text("[1, 2")
    line = _one_line_error(_start(model))
    assert "tokenizer_config.json" in line and "not valid JSON" in line


def test_sampling_defaults_no_request_could_use_stop_the_start(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "bad-generation-config"
    shutil.copytree(demo_model_dir, model)
    path = model / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "top_p": 1.5}))
    line = _one_line_error(_start(model))
    assert "generation_config.json" in line and "top_p" in line and "1.5" in line


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--max-input-chars", "0"), "--max-input-chars"),
        (("--max-token-ids", "-1"), "--max-token-ids"),
        (("--tls-cert", "cert.pem"), "--tls-key"),  # a cert without its key
    ],
)
def test_a_bad_flag_is_one_line_naming_it(
    demo_model_dir: Path, flags: tuple[str, ...], named: str
) -> None:
    """Found by a review: the tokenizer, alone of the services, let a flag's ValueError out
    as a traceback."""
    assert named in _one_line_error(_start(demo_model_dir, *flags))
