"""SamplingParams proto -> the engine's SamplingParams, shared by the prefill and decode edges.

Stop strings are not converted: prefill and decode work on token ids, and the frontend matches
stop strings on the detokenized text.
"""

from __future__ import annotations

from typing import Any

from mili.common.v1 import sampling_pb2
from mili.engine.sampling_params import SamplingParams
from mili.errors import FieldViolation, InvalidArgument

# proto3 `optional` fields copied when set; unset ones keep SamplingParams' defaults.
_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
)


def sampling_params(proto: sampling_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams; InvalidArgument names each bad field as `sampling.<field>`."""
    kwargs: dict[str, Any] = {f: getattr(proto, f) for f in _OPTIONAL_FIELDS if proto.HasField(f)}
    try:
        return SamplingParams(
            stop_token_ids=tuple(proto.stop_token_ids), ignore_eos=proto.ignore_eos, **kwargs
        )
    except InvalidArgument as err:
        raise InvalidArgument.many(
            [FieldViolation(f"sampling.{v.field}", v.description) for v in err.violations]
        ) from None
