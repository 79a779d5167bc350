"""When a generation ends: the one stop rule every service applies to each new token.

    check_stop(token_id, ...)   -> FinishReason.STOP    the token is a stop id (it is kept), or
                                                        it completed the request's constraint
                                -> FinishReason.LENGTH  max_tokens reached (the token counts), or
                                                        the context window is full
                                -> None                 keep going

The single-process `generate()`, decode's batch loop and the frontend (which re-checks what
decode streams, so a caller's contract holds whatever decode does) all call this function, so
the three can never disagree on the last token. Pure Python.
"""

from __future__ import annotations

import enum
from collections.abc import Collection


class FinishReason(enum.StrEnum):
    """Why a generation ended; the values are OpenTelemetry's gen_ai finish-reason names."""

    # EOS or another stop token id (the token is the last output), a stop string, or a
    # constraint (structured output) complete with nothing more allowed
    STOP = "stop"
    LENGTH = "length"  # max_tokens, or the context window is full


def check_stop(
    token_id: int,
    num_output_tokens: int,
    *,
    stop_token_ids: Collection[int],
    max_tokens: int,
    num_tokens: int = 0,
    max_context_tokens: int | None = None,
    is_constraint_finished: bool = False,
) -> FinishReason | None:
    """The finish reason `token_id` causes, or None.

    `num_output_tokens` counts the generated tokens including this one; `num_tokens` is prompt +
    output (only compared with `max_context_tokens`, when given). `is_constraint_finished`: the
    request's constraint accepted this token and allows nothing after it. A stop id or a
    finished constraint wins over a length limit reached by the same token.
    """
    if token_id in stop_token_ids or is_constraint_finished:
        return FinishReason.STOP
    if num_output_tokens >= max_tokens:
        return FinishReason.LENGTH
    if max_context_tokens is not None and num_tokens >= max_context_tokens:
        return FinishReason.LENGTH
    return None


def stop_token_set(
    stop_token_ids: Collection[int], eos_token_ids: Collection[int], *, ignore_eos: bool
) -> frozenset[int]:
    """The ids that end a generation: the request's own, plus the model's EOS ids unless
    `ignore_eos`."""
    ids = frozenset(stop_token_ids)
    return ids if ignore_eos else ids | frozenset(eos_token_ids)
