"""JSON text as JSON defines it: what Python's json.loads takes beyond that is refused.

json.loads reads `NaN`, `Infinity` and `-Infinity` (not JSON) and turns a number too large for a
float (`1e400`) into inf, which json.dumps then writes as `Infinity`. Tool parameters and call
arguments go both ways (a call the model made comes back in the next turn's messages), so both
directions read them with this one rule.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a JSON number here (a 64-bit float)")
    return value


def loads(text: str) -> Any:
    """`text` parsed (key order kept, ints stay ints); ValueError saying why it is not JSON
    (json.JSONDecodeError is one; so is nesting too deep for the parser)."""
    try:
        return json.loads(text, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("nested too deeply") from None
