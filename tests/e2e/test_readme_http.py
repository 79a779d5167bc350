"""The README's HTTP examples (curl lines and the `openai` SDK snippet), run as written against
the e2e pipeline: only the address changes (the README's localhost:8000 is the frontend's HTTP
port). In the README's order: /status asks about the /generate before it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import Deployment

ROOT = Path(__file__).resolve().parents[2]
CURL = shutil.which("curl")


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("### The HTTP API (OpenAI-compatible)", 1)[1].split("\n### ", 1)[0]


def _block(language: str) -> str:
    block = re.search(rf"```{language}\n(.*?)```", _section(), re.S)
    assert block is not None, f"README lost its HTTP {language} block"
    return block.group(1)


def readme_curl_lines() -> list[str]:
    joined = _block("sh").replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("curl ")]


def _check(command: str, out: str) -> None:
    """What each line's reply must hold (the demo model's text is gibberish: shapes, not words)."""
    if "/v1/models" in command:
        assert json.loads(out)["data"][0]["object"] == "model"
    elif "/v1/chat/completions" in command:
        reply = json.loads(out)
        assert reply["object"] == "chat.completion"
        choice = reply["choices"][0]
        assert isinstance(choice["message"]["content"], str)
        if '"response_format"' in command:  # the schema's JSON, whatever the weights
            assert choice["finish_reason"] == "stop", choice
            assert isinstance(json.loads(choice["message"]["content"])["name"], str)
    elif "/v1/responses" in command:
        reply = json.loads(out)
        assert reply["object"] == "response" and reply["status"] in ("completed", "incomplete")
        (message,) = reply["output"]  # thinking off: the answer alone
        assert message["type"] == "message" and isinstance(message["content"][0]["text"], str)
    elif '"stream": true' in command:
        events = [e for e in out.split("\n\n") if e]
        assert events[-1] == "data: [DONE]", out[-200:]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    elif '"echo": true' in command:
        choice = json.loads(out)["choices"][0]
        assert choice["text"].startswith("Hello")
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert all(v is not None for v in choice["logprobs"]["token_logprobs"][1:])
    elif "/generate" in command:
        reply = json.loads(out)
        assert reply["request_id"] == "hello-1"
        assert len(reply["tokens"]) == reply["completion_tokens"] >= 1
        assert reply["total_tokens"] == reply["prompt_tokens"] + reply["completion_tokens"]
    elif "/status/" in command:
        reply = json.loads(out)
        assert (reply["request_id"], reply["status"]) == ("hello-1", "completed")
    elif "/health" in command:
        assert json.loads(out) == {"status": "ok", "model_loaded": True, "scheduler_ready": True}
    else:
        raise AssertionError(f"no check for the README's {command!r}")


@pytest.mark.skipif(CURL is None, reason="curl is not installed")
def test_readme_curl_lines_work_as_written(pipeline: Deployment) -> None:
    lines = readme_curl_lines()
    assert len(lines) >= 5, lines
    url = pipeline.frontend.http_url.removeprefix("http://")
    for command in lines:
        line = command.replace("localhost:8000", url)
        result = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{command}\n{result.stderr}"
        _check(command, result.stdout)


def test_readme_openai_snippet_runs_as_written(pipeline: Deployment) -> None:
    code = _block("python").replace("http://localhost:8000", pipeline.frontend.http_url)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert "thinking:" in result.stdout and "answer:" in result.stdout
