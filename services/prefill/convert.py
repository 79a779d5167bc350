"""Proto <-> domain for the prefill service: a PrefillRequest becomes a validated PrefillTask,
and the transfer's result a PrefillResponse.

Every violation is reported at once, each naming its field as the caller set it
(`prompt_token_ids[3]`, `sampling.top_p`, `destination.prompt_block_ids`), as INVALID_ARGUMENT
with BadRequest details.
"""

from __future__ import annotations

from mili.engine.kv.block_pool import blocks_needed, max_cached_blocks
from mili.errors import FieldViolation, InvalidArgument, count_of
from mili.pb.common.v1 import sampling_pb2
from mili.pb.prefill.v1 import prefill_pb2
from mili.rpc.policy import MAX_REQUEST_ID_CHARS
from mili.rpc.sampling import logprobs_to_proto, sampling_params
from services.prefill.sender import TransferResult, logprobs
from services.prefill.task import FirstToken, PrefillTask


def prefill_task(
    request: prefill_pb2.PrefillRequest,
    *,
    vocab_size: int,
    max_prompt_tokens: int,
    block_size: int,
) -> PrefillTask:
    """Validate `request` against the model and this instance's limits."""
    violations: list[FieldViolation] = []

    def bad(field: str, value: object, reason: str) -> None:
        violations.append(FieldViolation.of(field, value, reason))

    if not request.request_id:
        bad("request_id", request.request_id, "must be set")
    elif len(request.request_id) > MAX_REQUEST_ID_CHARS:
        bad("request_id", request.request_id, f"longer than {MAX_REQUEST_ID_CHARS} characters")
    # Counted on the protobuf container (O(1)): a prompt too long is never converted.
    num_tokens = len(request.prompt_token_ids)
    token_ids: list[int] = []
    if not num_tokens:
        bad("prompt_token_ids", token_ids, "must hold at least one token")
    elif num_tokens > max_prompt_tokens:
        bad(
            "prompt_token_ids",
            count_of(num_tokens, "token"),
            f"longer than this instance's max_prompt_tokens {max_prompt_tokens}",
        )
    else:
        token_ids = list(request.prompt_token_ids)
        outside = [i for i, t in enumerate(token_ids) if t >= vocab_size]
        if outside:
            i = outside[0]
            bad(f"prompt_token_ids[{i}]", token_ids[i], f"outside the vocabulary [0, {vocab_size})")
    destination = request.destination
    if not destination.address:
        bad("destination.address", destination.address, "must be the decode's host:port")
    need = blocks_needed(num_tokens, block_size)
    num_block_ids = len(destination.prompt_block_ids)
    if not violations and num_block_ids != need:  # judged only for a valid prompt
        bad(
            "destination.prompt_block_ids",
            f"{num_block_ids} block ids",
            f"a {len(token_ids)}-token prompt needs exactly {need} blocks of {block_size} tokens",
        )
    num_cached_blocks = destination.num_cached_blocks
    most = max_cached_blocks(len(token_ids), block_size)
    if not violations and num_cached_blocks > most:
        # The block holding the last prompt token is always sent: decode never caches it.
        bad(
            "destination.num_cached_blocks",
            num_cached_blocks,
            f"at most {most} for a {len(token_ids)}-token prompt",
        )
    sampling = None
    try:
        sampling = sampling_params(request.sampling, vocab_size=vocab_size)
    except InvalidArgument as err:
        violations.extend(err.violations)
    try:
        if sampling is not None:
            sampling.check_prompt(num_tokens)
    except InvalidArgument as err:
        violations.extend(
            FieldViolation(f"sampling.{v.field}", v.description) for v in err.violations
        )
    if violations:
        raise InvalidArgument.many(violations)
    assert sampling is not None
    return PrefillTask(
        request_id=request.request_id,
        prompt_token_ids=token_ids,
        sampling=sampling,
        address=destination.address,
        prompt_block_ids=list(destination.prompt_block_ids),
        transfer_token=destination.transfer_token,
        num_cached_blocks=num_cached_blocks,
        client_request_id=request.client_request_id,
    )


def prefill_response(task: PrefillTask, result: TransferResult) -> prefill_pb2.PrefillResponse:
    first = result.first
    return prefill_pb2.PrefillResponse(
        first_token_id=first.token_id,
        first_logprobs=logprobs(first),
        num_prompt_tokens=len(task.prompt_token_ids),
        queue_ms=first.queue_ms,
        compute_ms=first.compute_ms,
        transfer_ms=result.transfer_ms,
        kv_bytes=result.kv_bytes,
        num_cached_tokens=first.num_cached_tokens,
        prompt_logprobs=_prompt_logprobs(task, first),
    )


def _prompt_logprobs(task: PrefillTask, first: FirstToken) -> list[sampling_pb2.Logprobs]:
    """Entry i - 1 for prompt token i, when they were asked for."""
    if first.prompt_logprobs is None:
        return []
    token_ids = task.prompt_token_ids[1:]
    return [
        logprobs_to_proto(t, lp) for t, lp in zip(token_ids, first.prompt_logprobs, strict=True)
    ]
