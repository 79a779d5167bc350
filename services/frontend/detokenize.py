"""One request's text: its generated token ids through the tokenizer's DetokenizeStream.

One bidi stream per request; every message we write gets exactly one reply, so the stream is
driven write-then-read. Ids the tokenizer does not know are left out of the text: a model's
embedding table is often padded past the vocabulary (Qwen3: 151936 rows, 151669 tokens), and
a random-weight model can sample those rows. They stay in the streamed token_ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from mili.errors import Unavailable
from mili.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.frontend.downstream import error_from


class TextStream:
    def __init__(
        self,
        stub: tokenizer_pb2_grpc.TokenizerServiceStub,
        who: str,
        vocab_size: int,
        *,
        timeout_s: float | None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._call = stub.DetokenizeStream(timeout=timeout_s)
        self._who = who  # "tokenizer at HOST:PORT", for error messages
        self._vocab_size = vocab_size
        self._skip_special_tokens = skip_special_tokens
        self._is_first = True

    async def push(self, token_ids: Sequence[int]) -> str:
        """The text these ids complete ("" while a character is still incomplete)."""
        known = [i for i in token_ids if i < self._vocab_size]
        if not known and not self._is_first:
            return ""
        return await self._send(tokenizer_pb2.DetokenizeStreamRequest(token_ids=known))

    async def finish(self) -> str:
        """Everything still held back; closes the stream."""
        text = await self._send(tokenizer_pb2.DetokenizeStreamRequest(final=True))
        await self._call.done_writing()
        return text

    def cancel(self) -> None:
        self._call.cancel()

    async def _send(self, request: tokenizer_pb2.DetokenizeStreamRequest) -> str:
        if self._is_first:
            request.skip_special_tokens = self._skip_special_tokens  # read from the first only
            self._is_first = False
        try:
            await self._call.write(request)
            reply = await self._call.read()
        except grpc.aio.AioRpcError as err:
            raise error_from(err, self._who) from None
        if reply is grpc.aio.EOF:
            raise Unavailable(f"{self._who} closed the DetokenizeStream early")
        text: str = reply.text
        return text
