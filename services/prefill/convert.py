"""Proto -> domain for the prefill service: a PrefillRequest becomes a validated PrefillTask.

Every violation is reported at once, each naming its field (`token_ids[3]`, `sampling.top_p`,
`destination.block_ids`), as INVALID_ARGUMENT with BadRequest details.
"""

from __future__ import annotations

from mili.engine.block_pool import blocks_needed
from mili.errors import FieldViolation, InvalidArgument
from mili.prefill.v1 import prefill_pb2
from mili.rpc.sampling import sampling_params
from services.prefill.task import PrefillTask

_MAX_REQUEST_ID_CHARS = 256


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
        violations.extend(InvalidArgument(field, value, reason).violations)

    if not request.request_id:
        bad("request_id", request.request_id, "must be set")
    elif len(request.request_id) > _MAX_REQUEST_ID_CHARS:
        bad("request_id", request.request_id, f"longer than {_MAX_REQUEST_ID_CHARS} characters")
    token_ids = list(request.token_ids)
    if not token_ids:
        bad("token_ids", token_ids, "must hold at least one token")
    elif len(token_ids) > max_prompt_tokens:
        bad(
            "token_ids",
            f"{len(token_ids)} tokens",
            f"longer than this instance's max_prompt_tokens {max_prompt_tokens}",
        )
    else:
        outside = [i for i, t in enumerate(token_ids) if t >= vocab_size]
        if outside:
            i = outside[0]
            bad(f"token_ids[{i}]", token_ids[i], f"outside the vocabulary [0, {vocab_size})")
    destination = request.destination
    if not destination.address:
        bad("destination.address", destination.address, "must be the decode's host:port")
    need = blocks_needed(len(token_ids), block_size)
    if not violations and len(destination.block_ids) < need:  # judged only for a valid prompt
        bad(
            "destination.block_ids",
            f"{len(destination.block_ids)} block ids",
            f"a {len(token_ids)}-token prompt needs {need} blocks of {block_size} tokens",
        )
    try:
        sampling = sampling_params(request.sampling)
    except InvalidArgument as err:
        violations.extend(err.violations)
    if violations:
        raise InvalidArgument.many(violations)
    return PrefillTask(
        request_id=request.request_id,
        token_ids=token_ids,
        sampling=sampling,
        address=destination.address,
        dest_block_ids=list(destination.block_ids[:need]),
    )
