"""Qwen3's own chat template (the `chat_template` of the Qwen/Qwen3-* checkpoints'
tokenizer_config.json, Apache-2.0) for the parity tests, without keeping a copy here.

Where it is found, first match wins:
1. the file MILI_QWEN3_CHAT_TEMPLATE names, or shared/data/qwen3_chat_template.jinja beside
   the repository;
2. this machine's cache (~/.cache/mili/qwen3-chat-template/, or $MILI_CACHE_DIR's);
3. PyPI, the one place CI reaches: llama-cpp-python's source distribution vendors llama.cpp,
   whose models/templates/ keeps Hugging Face's templates as published for its own template
   tests. The file is read out of the pinned release and checked against its SHA-256, so a
   changed upstream copy is refused, not tested against.

None when none is reachable: the tests that need it skip, saying why.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
_PACKAGE, _VERSION = "llama-cpp-python", "0.3.36"
_MEMBER = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Qwen-Qwen3-0.6B.jinja"
SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"
_TIMEOUT_S = 60.0

# Why the template is missing, when it is (for the skip message).
why_missing = ""


def qwen3_template() -> str | None:
    global why_missing
    named = os.environ.get("MILI_QWEN3_CHAT_TEMPLATE")
    local = Path(named) if named else _REPO.parent / "shared" / "data" / "qwen3_chat_template.jinja"
    if local.is_file():
        return local.read_text(encoding="utf-8")
    cache_root = Path(os.environ.get("MILI_CACHE_DIR") or Path.home() / ".cache" / "mili")
    cached = cache_root / "qwen3-chat-template" / f"{SHA256[:16]}.jinja"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    try:
        data = _from_pypi()
    except (OSError, ValueError, KeyError, tarfile.TarError) as e:
        why_missing = f"Qwen3's chat template: no local copy, and PyPI failed: {e}"
        return None
    if hashlib.sha256(data).hexdigest() != SHA256:
        why_missing = f"Qwen3's chat template in {_PACKAGE} {_VERSION} is not the pinned one"
        return None
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.part")  # concurrent runs: rename is atomic
    partial.write_bytes(data)
    partial.replace(cached)
    return data.decode("utf-8")


def _from_pypi() -> bytes:
    """The template's bytes out of the pinned sdist (~77 MB, read in memory, not unpacked)."""
    api = f"https://pypi.org/pypi/{_PACKAGE}/json"  # (the per-version form is not served here)
    with urllib.request.urlopen(api, timeout=_TIMEOUT_S) as response:
        release = json.load(response)["releases"][_VERSION]
    sdist = next(f for f in release if f["packagetype"] == "sdist")
    with urllib.request.urlopen(urllib.parse.urljoin(api, sdist["url"]), timeout=_TIMEOUT_S) as r:
        archive = r.read()
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        member = tar.extractfile(_MEMBER)
        if member is None:
            raise KeyError(_MEMBER)
        return member.read()
