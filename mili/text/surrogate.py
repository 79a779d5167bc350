"""Lone UTF-16 surrogates in parsed JSON.

JSON text may spell a character as `\\ud83d`; json.loads joins a high and a low surrogate into
one character but keeps a lone one (a client that cut a string inside an emoji) as a code point
that is not text: encoding it to UTF-8 (a protobuf string, a tokenizer) raises. Found here, it is
a 400 / INVALID_ARGUMENT naming where it is, before anything tries to encode it.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
# A JSON escape that may make one: the only way one gets into parsed JSON from UTF-8 bytes.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path (`messages[1].content`) of the first string of `value` (parsed JSON, keys
    included) holding a lone surrogate, or None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            name = f"{path}.{key}" if path else str(key)
            if _SURROGATE.search(str(key)):
                return name
            found = lone_surrogate_path(item, name)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None
