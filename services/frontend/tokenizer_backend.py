"""The tokenizer service as the frontend sees it (polled by backends.py): its stub, its Info
(model, vocabulary size, EOS ids, input limit) as last fetched, and its tokenizer file, loaded
here so that streams detokenize in this process (text.py). The service always hands the file
out; its DetokenizeStream stays for other clients.

    Info answered   -> a new tokenizer file digest: GetTokenizerFile, parsed off the event
                       loop -> `detokenizer` and `constraints` (the constraint compiler over
                       the same file); then `facts` (logged when they change)
    no answer, or   -> `facts` None (the frontend reports NOT_SERVING), Unavailable to callers
    no usable file
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from mili.engine.constraint.compiler import CompileConfig, ConstraintCompiler
from mili.engine.constraint.spec import Constraint
from mili.engine.constraint.vocab import GrammarTokenizer
from mili.engine.sampling_params import MODEL_DEFAULT_FIELDS
from mili.errors import Unavailable
from mili.pb.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mili.rpc.client import brief_details, connection_hint
from services.frontend.calls import TokenizerFacts
from services.frontend.downstream import error_from
from services.frontend.text import LocalDetokenizer

_LOG = logging.getLogger("mili.frontend")


class TokenizerBackend:
    def __init__(
        self,
        address: str,
        stub: tokenizer_pb2_grpc.TokenizerServiceStub,
        info_timeout_s: float,
        *,
        is_tls: bool = False,
        applies_sampling_defaults: bool = True,
    ) -> None:
        self.stub = stub
        self._info_timeout_s = info_timeout_s
        self._is_tls = is_tls  # for the hint when it refuses our handshake
        # Whether requests get the model's sampling defaults (--sampling-defaults): its log
        # line says the model's and whether they apply.
        self._applies_sampling_defaults = applies_sampling_defaults
        self.who = f"tokenizer at {address}"  # how errors and logs name it
        # None: down, or not asked yet. Once set, `detokenizer` holds the file its digest names.
        self.facts: TokenizerFacts | None = None
        # The tokenizer's file, loaded to detokenize here; None until its first load.
        self.detokenizer: LocalDetokenizer | None = None
        # Compiles requests' constraints once before admission, so that a bad one is
        # INVALID_ARGUMENT before any KV block is reserved (prefill and decode compile it again
        # for their model). None until the file loads, or when it cannot take one.
        self.constraints: ConstraintCompiler | None = None
        self._file_problem = ""  # why the file last failed to load, logged once per reason
        # Why Info last failed, logged once per reason: a tokenizer that was never up (a wrong
        # address, a refused handshake) would otherwise leave only health's "is down".
        self._down_reason = ""

    async def current_facts(self) -> TokenizerFacts:
        """The facts as last fetched, fetched now if there are none; raises Unavailable (or the
        tokenizer's own status) when it does not answer."""
        if self.facts is None:
            await self.fetch()
            assert self.facts is not None
        return self.facts

    async def fetch(self) -> None:
        """Ask the tokenizer's Info, and its file when the digest is new; on failure forget the
        facts and raise its error."""
        try:
            info = await self.stub.Info(tokenizer_pb2.InfoRequest(), timeout=self._info_timeout_s)
        except grpc.aio.AioRpcError as err:
            reason = f"{err.code().name}: {brief_details(err)}"
            if self.facts is not None or reason != self._down_reason:
                what = "is down" if self.facts is not None else "does not answer"
                hint = connection_hint(err, is_tls=self._is_tls)
                _LOG.warning("%s %s: %s%s", self.who, what, reason, hint)
            self._down_reason = reason
            self.facts = None
            raise error_from(err, self.who) from None
        try:
            await self._load_file(info.tokenizer_file_sha256, info)
        except Unavailable as err:
            if str(err) != self._file_problem:
                self._file_problem = str(err)
                _LOG.warning("%s", err)
            self.facts = None
            raise
        self._file_problem = self._down_reason = ""
        facts = TokenizerFacts(
            model=info.model,
            vocab_size=info.vocab_size,
            eos_token_ids=tuple(info.eos_token_ids),
            max_input_chars=info.max_input_chars,
            tokenizer_file_sha256=info.tokenizer_file_sha256,
            sampling_defaults=tuple(
                (f, getattr(info.sampling_defaults, f))
                for f in MODEL_DEFAULT_FIELDS
                if info.sampling_defaults.HasField(f)
            ),
        )
        if facts != self.facts:
            defaults = " ".join(f"{f}={v:.6g}" for f, v in facts.sampling_defaults) or "none"
            if facts.sampling_defaults and not self._applies_sampling_defaults:
                defaults += " (not applied: --sampling-defaults none)"
            _LOG.info(
                "%s is up: model %s, vocab %d, eos %s, the model's sampling defaults %s",
                self.who,
                info.model,
                info.vocab_size,
                list(info.eos_token_ids),
                defaults,
            )
        self.facts = facts

    def forget(self) -> None:
        """It failed a call: fetch its Info again next time (it may have restarted)."""
        self.facts = None

    async def poll(self) -> None:
        """One polling round (`fetch`). Failures leave `facts` None (reported by the frontend's
        health), never raise."""
        with contextlib.suppress(Exception):
            await self.fetch()

    async def compile_constraint(self, constraint: Constraint) -> None:
        """Compile `constraint` (off the event loop; cached): InvalidArgument naming its field,
        or ResourceExhausted, when prefill and decode would refuse it too. A no-op while no
        compiler is loaded (they still check it)."""
        await self.current_facts()
        if self.constraints is not None:
            await self.constraints.compile(constraint)

    async def _load_file(self, sha256: str, info: tokenizer_pb2.InfoResponse) -> None:
        """Load the tokenizer file Info names (`sha256`) for detokenizing in this process
        (text.py), unless it is loaded already; raises Unavailable when it cannot."""
        if self.detokenizer is not None and self.detokenizer.sha256 == sha256:
            return
        try:
            reply = await self.stub.GetTokenizerFile(
                tokenizer_pb2.GetTokenizerFileRequest(), timeout=self._info_timeout_s * 10
            )
            if reply.sha256 != sha256:
                raise ValueError(f"it sent the file {reply.sha256[:12]}, Info named {sha256[:12]}")
            # Parsing a 150k-token vocabulary takes most of a second: off the event loop.
            loaded = await asyncio.to_thread(LocalDetokenizer, reply.tokenizer_json, reply.sha256)
            self.constraints = await asyncio.to_thread(_compiler, reply.tokenizer_json, info)
        except (grpc.aio.AioRpcError, ValueError) as err:
            why = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.RpcError) else err
            raise Unavailable(f"{self.who}: no usable tokenizer file ({why})") from None
        self.detokenizer = loaded
        _LOG.info("detokenizing with the tokenizer file of %s (%s)", self.who, sha256[:12])


def _compiler(tokenizer_json: bytes, info: tokenizer_pb2.InfoResponse) -> ConstraintCompiler | None:
    """The frontend's constraint compiler over the tokenizer file (about a second for a
    Qwen3-sized vocabulary; run off the event loop). Its masks are never used here, only its
    verdict, which the model's padded rows do not change: the tokenizer's own size stands in
    for them. None (logged) when the file cannot take one."""
    try:
        tokenizer = GrammarTokenizer(tokenizer_json, info.vocab_size, list(info.eos_token_ids))
    except ValueError as e:
        _LOG.warning("constraints are checked by prefill and decode only: %s", e)
        return None
    compiler = ConstraintCompiler(tokenizer, CompileConfig())
    compiler.warm()
    return compiler
