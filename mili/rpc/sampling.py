"""mili.common.v1 sampling messages <-> the engine's domain types, shared by every service's edge:
SamplingParams (with its constraint), per-token Logprobs and FinishReason.

Stop strings are not sent: prefill and decode work on token ids, and the frontend matches stop
strings on the detokenized text.
"""

from __future__ import annotations

from typing import Any, cast

from mili.engine.constraint.spec import Constraint, ConstraintKind, ThinkBlock
from mili.engine.logprobs import TokenLogprobs
from mili.engine.sampling_params import OPTIONAL_FIELDS, SamplingParams
from mili.engine.stop import FinishReason
from mili.errors import FieldViolation, InvalidArgument
from mili.pb.common.v1 import sampling_pb2

_FINISH_REASONS = {
    None: sampling_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: sampling_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: sampling_pb2.FINISH_REASON_LENGTH,
}
_FINISH_REASONS_FROM_PROTO = {value: reason for reason, value in _FINISH_REASONS.items()}


def sampling_params(proto: sampling_pb2.SamplingParams, *, vocab_size: int) -> SamplingParams:
    """The engine's SamplingParams, its token ids below the tokenizer's `vocab_size`;
    InvalidArgument names each bad field as `sampling.<field>`."""
    kwargs: dict[str, Any] = {f: getattr(proto, f) for f in OPTIONAL_FIELDS if proto.HasField(f)}
    try:
        params = SamplingParams(
            min_tokens=proto.min_tokens,
            logit_bias=tuple(sorted(proto.logit_bias.items())),
            stop_token_ids=tuple(proto.stop_token_ids),
            ignore_eos=proto.ignore_eos,
            constraint=constraint_from_proto(proto),
            **kwargs,
        )
        params.check_vocabulary(vocab_size)
        return params
    except InvalidArgument as err:
        raise InvalidArgument.many(
            [FieldViolation(f"sampling.{v.field}", v.description) for v in err.violations]
        ) from None


def sampling_params_to_proto(params: SamplingParams) -> sampling_pb2.SamplingParams:
    """Every field set (the seed when there is one), so the receiver applies no default."""
    proto = sampling_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_tokens,
        logit_bias=dict(params.logit_bias),
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        proto.seed = params.seed
    if params.logprobs is not None:
        proto.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        proto.prompt_logprobs = params.prompt_logprobs
    if params.constraint is not None:
        set_constraint(proto, params.constraint)
    return proto


_THINK_BLOCKS: dict[ThinkBlock, sampling_pb2.ThinkBlock] = {
    "none": sampling_pb2.THINK_BLOCK_UNSPECIFIED,
    "optional": sampling_pb2.THINK_BLOCK_OPTIONAL,
    "open": sampling_pb2.THINK_BLOCK_OPEN,
}
_THINK_BLOCKS_FROM_PROTO = {value: think for think, value in _THINK_BLOCKS.items()}


def constraint_from_proto(proto: sampling_pb2.SamplingParams) -> Constraint | None:
    """The `constraint` oneof as a Constraint (json_object false: none), behind its
    `think_block` (InvalidArgument naming `think_block` for an unknown one). Sizes are checked
    where it is compiled (mili.engine.constraint.spec.validate)."""
    kind = proto.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not proto.json_object):
        return None
    if kind == "json_object":
        constraint = Constraint.json_object()
    elif kind == "choice":
        constraint = Constraint.choice(tuple(proto.choice.choices))
    else:
        constraint = Constraint(cast(ConstraintKind, kind), getattr(proto, kind))
    # A value this build does not know (a newer sender's) is refused, not read as none.
    think = _THINK_BLOCKS_FROM_PROTO.get(proto.think_block)
    if think is None:
        raise InvalidArgument("think_block", proto.think_block, "not a ThinkBlock")
    return constraint.after_think(think)


def set_constraint(proto: sampling_pb2.SamplingParams, constraint: Constraint) -> None:
    """Set the `constraint` oneof of `proto` to `constraint`, and its `think_block`."""
    if constraint.kind == "json_object":
        proto.json_object = True
    elif constraint.kind == "choice":
        proto.choice.choices.extend(constraint.choices)
    else:
        setattr(proto, constraint.kind, constraint.text)
    proto.think_block = _THINK_BLOCKS[constraint.think]


def logprobs_from_proto(proto: sampling_pb2.Logprobs) -> TokenLogprobs:
    top = [(t.token_id, t.logprob) for t in proto.top]
    return TokenLogprobs(proto.chosen.logprob, top, proto.chosen_rank)


def logprobs_to_proto(token_id: int, logprobs: TokenLogprobs) -> sampling_pb2.Logprobs:
    return sampling_pb2.Logprobs(
        chosen=sampling_pb2.TokenLogprob(token_id=token_id, logprob=logprobs.logprob),
        top=[sampling_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
        chosen_rank=logprobs.rank,
    )


def finish_reason_to_proto(reason: FinishReason | None) -> sampling_pb2.FinishReason:
    return _FINISH_REASONS[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """None for FINISH_REASON_UNSPECIFIED (and for a value this version does not know)."""
    return _FINISH_REASONS_FROM_PROTO.get(value)  # type: ignore[call-overload]
