"""Proto <-> domain conversion for the frontend: the only place request protos are unpacked."""

from __future__ import annotations

from mili.common.v1 import chat_pb2, sampling_pb2
from mili.frontend.v1 import generation_pb2
from services.frontend.validation import ChatTurn, RequestInput, Sampling, SamplingInput

FINISH_REASONS = {
    "stop": sampling_pb2.FINISH_REASON_STOP,
    "length": sampling_pb2.FINISH_REASON_LENGTH,
}
FINISH_NAMES = {value: name for name, value in FINISH_REASONS.items()}


def sampling_input(s: sampling_pb2.SamplingParams) -> SamplingInput:
    return SamplingInput(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        min_p=s.min_p if s.HasField("min_p") else None,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else None,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else None,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
    )


def request_input(
    request: generation_pb2.GenerateRequest | generation_pb2.CompleteRequest,
) -> RequestInput:
    return RequestInput(
        request_id=request.request_id,
        prompt=request.prompt,
        messages=tuple(
            ChatTurn(
                role=m.role,
                content=m.content,
                reasoning_content=m.reasoning_content if m.HasField("reasoning_content") else None,
            )
            for m in request.messages
        ),
        token_ids=tuple(request.token_ids),
        sampling=sampling_input(request.sampling),
        enable_thinking=request.enable_thinking if request.HasField("enable_thinking") else None,
    )


def chat_messages(turns: tuple[ChatTurn, ...]) -> list[chat_pb2.ChatMessage]:
    messages = []
    for t in turns:
        message = chat_pb2.ChatMessage(role=t.role, content=t.content)
        if t.reasoning_content is not None:
            message.reasoning_content = t.reasoning_content
        messages.append(message)
    return messages


def sampling_proto(s: Sampling) -> sampling_pb2.SamplingParams:
    """Every field set, so prefill and decode apply no default of their own.

    Stop strings stay here: they are matched on text, which only the frontend sees.
    """
    proto = sampling_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
    )
    if s.logprobs is not None:
        proto.logprobs = s.logprobs
    return proto
