"""The tokenizer service as the frontend sees it (polled by backends.py): its stub, its Info
(model, vocabulary size, EOS ids, input limit) as last fetched, and its tokenizer file, loaded
here when it hands one out, so that streams detokenize in this process (text.py) instead of
through the service.

    Info answered   -> `facts` (logged when they change); a new tokenizer file digest ->
                       GetTokenizerFile, parsed off the event loop -> `local_detokenizer`
    no answer       -> `facts` None (the frontend reports NOT_SERVING), Unavailable to callers
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from mili.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.frontend.calls import TokenizerFacts
from services.frontend.downstream import error_from
from services.frontend.text import LocalDetokenizer

_LOG = logging.getLogger("mili.frontend")


class TokenizerBackend:
    def __init__(
        self, address: str, stub: tokenizer_pb2_grpc.TokenizerServiceStub, info_timeout_s: float
    ) -> None:
        self.stub = stub
        self._info_timeout_s = info_timeout_s
        self.who = f"tokenizer at {address}"  # how errors and logs name it
        self.facts: TokenizerFacts | None = None  # None: down, or not asked yet
        # The tokenizer's file, loaded to detokenize here; None: detokenize through the service.
        self.local_detokenizer: LocalDetokenizer | None = None

    async def current_facts(self) -> TokenizerFacts:
        """The facts as last fetched, fetched now if there are none; raises Unavailable (or the
        tokenizer's own status) when it does not answer."""
        if self.facts is None:
            await self.fetch()
            assert self.facts is not None
        return self.facts

    async def fetch(self) -> None:
        """Ask the tokenizer's Info; on failure forget the facts and raise its error."""
        try:
            info = await self.stub.Info(tokenizer_pb2.InfoRequest(), timeout=self._info_timeout_s)
        except grpc.aio.AioRpcError as err:
            if self.facts is not None:
                _LOG.warning("%s is down: %s: %s", self.who, err.code().name, err.details())
            self.facts = None
            raise error_from(err, self.who) from None
        facts = TokenizerFacts(
            model=info.model,
            vocab_size=info.vocab_size,
            eos_token_ids=tuple(info.eos_token_ids),
            max_input_chars=info.max_input_chars,
            tokenizer_file_sha256=info.tokenizer_file_sha256,
        )
        if facts != self.facts:
            _LOG.info(
                "%s is up: model %s, vocab %d, eos %s",
                self.who,
                info.model,
                info.vocab_size,
                list(info.eos_token_ids),
            )
        self.facts = facts

    def forget(self) -> None:
        """It failed a call: fetch its Info again next time (it may have restarted)."""
        self.facts = None

    async def poll(self) -> None:
        """One polling round: Info, then the tokenizer file when its digest is new. Failures
        leave `facts` None (reported by the frontend's health), never raise."""
        with contextlib.suppress(Exception):
            await self.fetch()
            await self._sync_detokenizer()

    async def _sync_detokenizer(self) -> None:
        """Load the tokenizer's file for detokenizing in this process (text.py) when its digest
        is new; without one (a tokenizer that does not hand it out), detokenize through it."""
        sha256 = "" if self.facts is None else self.facts.tokenizer_file_sha256
        if not sha256:
            self.local_detokenizer = None
            return
        if self.local_detokenizer is not None and self.local_detokenizer.sha256 == sha256:
            return
        try:
            reply = await self.stub.GetTokenizerFile(
                tokenizer_pb2.GetTokenizerFileRequest(), timeout=self._info_timeout_s * 10
            )
            # Parsing a 150k-token vocabulary takes most of a second: off the event loop.
            local = await asyncio.to_thread(LocalDetokenizer, reply.tokenizer_json, reply.sha256)
        except (grpc.aio.AioRpcError, ValueError) as err:
            self.local_detokenizer = None
            why = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.RpcError) else err
            _LOG.warning("%s: no tokenizer file (%s); detokenizing through it", self.who, why)
            return
        self.local_detokenizer = local
        _LOG.info(
            "detokenizing in process with the tokenizer file of %s (%s)", self.who, sha256[:12]
        )
