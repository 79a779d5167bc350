"""An HTTP request's JSON body: read off the connection within a time limit (`read_body`), then
field by field: each wrong type is an InvalidArgument naming the parameter as the caller wrote
it (`top_p`, `messages[2].content`), so the 400 says what to fix. JSON `null` counts as unset
everywhere, as OpenAI's API treats it.

Plain Python over the parsed body; no schema library: a request is read once, by the handler
that serves it, and its few dozen fields cost microseconds here.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from aiohttp import web

from mili.errors import InvalidArgument, count_of
from mili.text.surrogate import SURROGATE_ESCAPE, lone_surrogate_path

# Integer fields must fit in 64 bits (seed is the widest: unsigned); larger ones are refused
# here, before a huge int reaches arithmetic.
_MAX_INT = 2**64


# The most a request's body may take to arrive (HttpConfig.body_timeout_s).
BODY_TIMEOUT_S = web.AppKey("body_timeout_s", float)


async def read_body(request: web.Request) -> bytes:
    """The request's body, within the app's time for it: a client that announced a body and
    sends it slowly (or never) would hold its connection and its handler for as long as it
    liked. Past it, a 408 (`openai_errors`). A body announced over the app's limit is a 413
    before any of it is read: aiohttp counts the limit only as the bytes arrive."""
    announced = request.content_length or 0
    if announced > request.client_max_size:
        raise web.HTTPRequestEntityTooLarge(request.client_max_size, announced)
    try:
        async with asyncio.timeout(request.app[BODY_TIMEOUT_S]):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout() from None


def parse(raw: bytes) -> Body:
    """The body as a JSON object; InvalidArgument (param unset) when it is not one."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        why = f"the body is not valid JSON: {err}"
        raise InvalidArgument("", count_of(len(raw), "byte"), why) from None
    except RecursionError:
        why = "the body nests too deeply"
        raise InvalidArgument("", count_of(len(raw), "byte"), why) from None
    if not isinstance(data, dict):
        raise InvalidArgument("", type(data).__name__, "the body must be a JSON object")
    if SURROGATE_ESCAPE.search(raw):  # rare: the walk only for a body that may hold one
        where = lone_surrogate_path(data)
        if where is not None:
            raise InvalidArgument(where, "\\ud800-\\udfff", _LONE_SURROGATE)
    return Body(data)


_LONE_SURROGATE = (
    "holds a lone UTF-16 surrogate escape: not text (a string cut inside a character?)"
)


def type_name(value: object) -> str:
    """A JSON value's type as JSON names it, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Body:
    """A JSON object's fields, read with the type each must have; `path` prefixes the names in
    errors (a message inside `messages`)."""

    def __init__(self, data: dict[str, Any], path: str = "") -> None:
        self.data = data
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str) -> Any:
        return self.data.get(key)

    def wrong(self, key: str, value: object, expected: str) -> InvalidArgument:
        return InvalidArgument(self.name(key), value, f"must be {expected}, not {type_name(value)}")

    def text(self, key: str) -> str | None:
        value = self.data.get(key)
        if value is None or isinstance(value, str):
            return value
        raise self.wrong(key, value, "a string")

    def flag(self, key: str) -> bool | None:
        value = self.data.get(key)
        if value is None or isinstance(value, bool):
            return value
        raise self.wrong(key, value, "a boolean")

    def integer(self, key: str) -> int | None:
        value = self.data.get(key)
        if value is None:
            return None
        if not is_int(value):
            raise self.wrong(key, value, "an integer")
        if not -_MAX_INT < value < _MAX_INT:
            raise InvalidArgument(self.name(key), value, "out of range: must fit in 64 bits")
        return int(value)

    def number(self, key: str) -> float | None:
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.wrong(key, value, "a number")
        try:
            number = float(value)
        except OverflowError:  # an integer past a float's range
            number = math.inf
        if not math.isfinite(number):
            raise InvalidArgument(self.name(key), value, "must be a finite number")
        return number

    def array(self, key: str) -> list[Any] | None:
        value = self.data.get(key)
        if value is None or isinstance(value, list):
            return value
        raise self.wrong(key, value, "an array")

    def object(self, key: str) -> Body | None:
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.wrong(key, value, "an object")
        return Body(value, self.name(key))

    def texts(self, key: str) -> tuple[str, ...]:
        """A string or an array of strings (OpenAI's `stop`)."""
        value = self.data.get(key)
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise self.wrong(key, value, "a string or an array of strings")

    def integers(self, key: str) -> tuple[int, ...]:
        value = self.data.get(key)
        if value is None:
            return ()
        if isinstance(value, list) and all(is_int(v) and -_MAX_INT < v < _MAX_INT for v in value):
            return tuple(value)
        raise self.wrong(key, value, "an array of integers")
