"""Admission of one decode request, whichever call carries it: a Generate call of its own or a
GenerateStream shared with the caller's other requests (multiplex.py). Both check the request
and reserve its blocks here, so both refuse and admit exactly alike."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from mili.engine.constraint.compiler import compile_for
from mili.errors import DeadlineExceeded, InvalidArgument, count_of
from mili.pb.decode.v1 import decode_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.plural import plural
from mili.rpc.kv_layout import check_compatible
from mili.rpc.sampling import sampling_params
from services.decode.instance import DecodeInstance
from services.decode.requests import DecodeRequest
from services.decode.stream import Outlet, TokenStream


class Admission:
    """Checks `decode_pb2.GenerateRequest`s against one instance and admits them to its table."""

    def __init__(
        self,
        instance: DecodeInstance,
        layout: kv_pb2.KvLayout,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._instance = instance
        self._layout = layout  # this instance's, as Info reports it
        self._clock = clock

    async def admit(self, request: decode_pb2.GenerateRequest) -> tuple[DecodeRequest, Outlet]:
        """Reserve the request's blocks and open its outlet (the caller `release`s it when its
        call ends); raises InvalidArgument (a constraint that does not compile too),
        FailedPrecondition (layouts differ) or ResourceExhausted (with RetryInfo) without
        reserving anything. A constraint is compiled here, off the event loop and the batch
        thread (a cache hit after the first request with it), before any block is reserved."""
        inst = self._instance
        request_id = request.request_id
        # Counted on the protobuf container (O(1)) before any id becomes a Python int.
        num_prompt_tokens = len(request.prompt_token_ids)
        if num_prompt_tokens > inst.max_context_tokens:
            raise InvalidArgument(
                "prompt_token_ids",
                count_of(num_prompt_tokens, "id"),
                f"longer than the model's context of {inst.max_context_tokens} tokens",
            )
        prompt = list(request.prompt_token_ids)
        if not request_id:
            raise InvalidArgument("request_id", request_id, "must be non-empty")
        self._check_prompt(prompt)
        params = sampling_params(request.sampling, vocab_size=inst.vocab_size)
        if len(prompt) + params.max_tokens > inst.max_context_tokens:
            raise InvalidArgument(
                "sampling.max_tokens",
                params.max_tokens,
                f"{len(prompt)} prompt tokens + max_tokens exceed the model's context of "
                f"{inst.max_context_tokens} tokens",
            )
        if not request.HasField("prefill_layout"):
            # Without it a mismatch would surface only as a failed transfer, after the blocks
            # were held for a whole lease.
            raise InvalidArgument(
                "prefill_layout", None, "required: the KV layout of the prefill instance"
            )
        check_compatible(
            self._layout,
            request.prefill_layout,
            local_name="this decode instance",
            remote_name="the prefill instance",
        )
        compiled = await compile_for(inst.constraints, params.constraint)
        # A caller may ask for a shorter lease, never a longer one: the operator's --kv-lease-ms
        # bounds how long a vanished prefill can strand blocks. Admitted reports the one in force.
        lease_ms = min(request.kv_lease_ms or inst.config.kv_lease_ms, inst.config.kv_lease_ms)
        req = inst.table.admit(
            request_id,
            prompt,
            params,
            lease_ms=lease_ms,
            now=self._clock(),
            retry_after_s=inst.config.retry_after_s,
            client_request_id=request.client_request_id,
            priority=request.priority,
        )
        if compiled is not None:
            req.matcher = compiled.matcher()
        return req, inst.outlets.open(request_id, TokenStream(asyncio.get_running_loop()))

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise InvalidArgument("prompt_token_ids", prompt, "must hold at least one token id")
        vocab_size = self._instance.vocab_size
        bad = [t for t in prompt if t >= vocab_size]
        if bad:
            raise InvalidArgument(
                "prompt_token_ids",
                bad[:8],
                f"{len(bad)} token id(s) outside the vocabulary [0, {vocab_size})",
            )


def lease_expired(request: DecodeRequest) -> DeadlineExceeded:
    """The error of a request whose KV did not arrive within its lease (its blocks are freed)."""
    return DeadlineExceeded(
        f"the KV of request {request.name} did not arrive within its lease of "
        f"{request.lease_ms} ms; released its {plural(len(request.block_table), 'KV block')}"
    )
