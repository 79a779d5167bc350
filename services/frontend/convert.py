"""Proto <-> domain conversion for the frontend: the only frontend module besides the servicer
(server.py) and the clients (clients.py, backends.py, tokenizer_backend.py) that touches generated
`*_pb2`. Requests come in as `RequestInput`, go downstream from domain types, and come back as
`calls.Admitted` / `calls.Tokens` / `calls.PrefillStats`; `Delta`s go out as responses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mili.errors import InvalidArgument
from mili.pb.common.v1 import chat_pb2, sampling_pb2
from mili.pb.decode.v1 import decode_pb2
from mili.pb.frontend.v1 import generation_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.pb.prefill.v1 import prefill_pb2
from mili.pb.tokenizer.v1 import tokenizer_pb2
from mili.rpc.sampling import (
    constraint_from_proto,
    finish_reason_from_proto,
    finish_reason_to_proto,
    logprobs_from_proto,
    logprobs_to_proto,
    sampling_params_to_proto,
)
from services.frontend.calls import Admitted, PrefillStats, Prompt, RequestIds, Tokens
from services.frontend.chat_output import ChatOutput, OutputPiece
from services.frontend.pipeline import Delta
from services.frontend.router import Member, State
from services.frontend.tools import FunctionTool, ToolCallInput, ToolChoice, ToolChoiceMode
from services.frontend.validation import (
    ChatTurn,
    Counts,
    RequestInput,
    SamplingInput,
    ValidRequest,
    check_counts,
)

# ---- the caller's request ----------------------------------------------------------------------


def sampling_input(s: sampling_pb2.SamplingParams) -> SamplingInput:
    if s.think_block:  # prompt.py sets it for prefill and decode
        known = s.think_block in sampling_pb2.ThinkBlock.values()
        raise InvalidArgument(
            "sampling.think_block",
            sampling_pb2.ThinkBlock.Name(s.think_block) if known else s.think_block,
            "the frontend sets it from enable_thinking (a chat with thinking on thinks before "
            "its constraint; false: constrained from the first token): leave it unset",
        )
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
        min_tokens=s.min_tokens,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        constraint=constraint_from_proto(s),
    )


def sampling_defaults(
    defaults: Sequence[tuple[str, float | int]],
) -> sampling_pb2.SamplingParams:
    """The (field, value) defaults as the Info reply's SamplingParams (those fields set)."""
    fields: dict[str, Any] = dict(defaults)
    return sampling_pb2.SamplingParams(**fields)


def request_input(
    request: generation_pb2.GenerateRequest | generation_pb2.CompleteRequest,
    max_context_tokens: int | None,
) -> RequestInput:
    """The request as sent, once its lists are known to be no longer than any valid request's
    (validation.check_counts: InvalidArgument before any of them is converted)."""
    sampling = request.sampling
    counts = Counts(
        len(request.token_ids),
        len(request.messages),
        len(sampling.stop),
        len(sampling.stop_token_ids),
        len(sampling.logit_bias),
    )
    check_counts(counts, max_context_tokens)
    return RequestInput(
        client_request_id=request.request_id,
        prompt=request.prompt,
        messages=tuple(_chat_turn(m) for m in request.messages),
        token_ids=tuple(request.token_ids),
        sampling=sampling_input(request.sampling),
        enable_thinking=request.enable_thinking if request.HasField("enable_thinking") else None,
        allow_special_tokens=request.allow_special_tokens,
        tools=_tools(request.tools),
        tool_choice=ToolChoice(
            _tool_choice_mode(request.tool_choice.mode), request.tool_choice.function_name
        ),
        parallel_tool_calls=(
            request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
        ),
        priority=request.priority,
    )


def tokenize_input(
    request: generation_pb2.TokenizeRequest, max_context_tokens: int | None
) -> RequestInput:
    """A Tokenize call's prompt as a request's input, its lists counted first (request_input)."""
    check_counts(Counts(0, len(request.messages), 0, 0, 0), max_context_tokens)
    return RequestInput(
        client_request_id=request.request_id,
        prompt=request.prompt,
        messages=tuple(_chat_turn(m) for m in request.messages),
        enable_thinking=request.enable_thinking if request.HasField("enable_thinking") else None,
        allow_special_tokens=request.allow_special_tokens,
        tools=_tools(request.tools),
    )


def _tools(tools: Sequence[chat_pb2.Tool]) -> tuple[FunctionTool, ...]:
    return tuple(
        FunctionTool(
            t.name,
            t.description,
            t.parameters,
            t.strict if t.HasField("strict") else None,
            tuple(t.function_keys),
        )
        for t in tools
    )


_TOOL_CHOICE_MODES: dict[int, ToolChoiceMode] = {
    generation_pb2.TOOL_CHOICE_MODE_UNSPECIFIED: "auto",
    generation_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    generation_pb2.TOOL_CHOICE_MODE_NONE: "none",
    generation_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
    generation_pb2.TOOL_CHOICE_MODE_FUNCTION: "function",
}


def _tool_choice_mode(mode: int) -> ToolChoiceMode:
    """A ToolChoiceMode number a client sent; one this contract does not have is its mistake."""
    name = _TOOL_CHOICE_MODES.get(mode)
    if name is None:
        known = ", ".join(str(m) for m in _TOOL_CHOICE_MODES)
        raise InvalidArgument("tool_choice.mode", mode, f"not a ToolChoiceMode (one of {known})")
    return name


def _chat_turn(m: chat_pb2.ChatMessage) -> ChatTurn:
    return ChatTurn(
        role=m.role,
        content=m.content,
        reasoning_content=m.reasoning_content if m.HasField("reasoning_content") else None,
        tool_calls=tuple(ToolCallInput(c.id, c.name, c.arguments) for c in m.tool_calls),
        tool_call_id=m.tool_call_id,
    )


# ---- our replies ------------------------------------------------------------------------------


def _logprobs(delta: Delta) -> list[sampling_pb2.Logprobs]:
    if not delta.logprobs:  # none asked for
        return []
    return [logprobs_to_proto(t, lp) for t, lp in zip(delta.token_ids, delta.logprobs, strict=True)]


def _prompt_logprobs(delta: Delta) -> list[sampling_pb2.Logprobs]:
    """The first delta's prompt logprobs: entry i - 1 is prompt token i's."""
    if delta.prompt_logprobs is None or delta.prompt_token_ids is None:
        return []
    token_ids = delta.prompt_token_ids[1:]
    return [
        logprobs_to_proto(t, lp) for t, lp in zip(token_ids, delta.prompt_logprobs, strict=True)
    ]


def generate_response(
    client_request_id: str, delta: Delta, output: ChatOutput | None = None
) -> generation_pb2.GenerateResponse:
    """One message of the stream; a chat request's `output` splits its text (chat_output.py)."""
    # Once per message sent: only the fields that are set (the rest default to empty).
    if output is None:
        response = generation_pb2.GenerateResponse(
            request_id=client_request_id, token_ids=delta.token_ids, text=delta.text
        )
    else:
        piece = output.push(
            delta.text,
            is_last=delta.finish_reason is not None,
            starts_in_reasoning=delta.starts_in_reasoning,
        )
        response = generation_pb2.GenerateResponse(
            request_id=client_request_id,
            token_ids=delta.token_ids,
            text=piece.content,
            reasoning_text=piece.reasoning,
        )
        if piece.tool_calls:
            response.tool_calls.extend(_tool_calls(piece))
    if delta.logprobs:
        response.logprobs.extend(_logprobs(delta))
    if delta.prompt_logprobs is not None:
        response.prompt_logprobs.extend(_prompt_logprobs(delta))
    if delta.finish_reason is not None:
        response.finish_reason = finish_reason_to_proto(delta.finish_reason)
        response.usage.prompt_tokens = delta.num_prompt_tokens
        response.usage.completion_tokens = delta.num_completion_tokens
        response.usage.cached_prompt_tokens = delta.num_cached_tokens
    return response


def complete_response(
    client_request_id: str, deltas: Sequence[Delta], output: ChatOutput | None = None
) -> generation_pb2.CompleteResponse:
    """The deltas of one generation (the last one finished it) in one reply; a chat request's
    `output` splits its text into answer, reasoning and tool calls."""
    reply = generation_pb2.CompleteResponse(request_id=client_request_id)
    for delta in deltas:
        reply.token_ids.extend(delta.token_ids)
        reply.logprobs.extend(_logprobs(delta))
        reply.prompt_logprobs.extend(_prompt_logprobs(delta))
        if delta.finish_reason is not None:
            reply.finish_reason = finish_reason_to_proto(delta.finish_reason)
            reply.usage.prompt_tokens = delta.num_prompt_tokens
            reply.usage.completion_tokens = delta.num_completion_tokens
            reply.usage.cached_prompt_tokens = delta.num_cached_tokens
    text = "".join(d.text for d in deltas)
    if output is None:
        reply.text = text
        return reply
    starts_in_reasoning = any(d.starts_in_reasoning for d in deltas)
    piece = output.push(text, is_last=True, starts_in_reasoning=starts_in_reasoning)
    reply.text, reply.reasoning_text = piece.content, piece.reasoning
    reply.tool_calls.extend(_tool_calls(piece))
    return reply


def _tool_calls(piece: OutputPiece) -> list[chat_pb2.ToolCall]:
    calls = piece.tool_calls
    return [chat_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


# ---- downstream -------------------------------------------------------------------------------


def tool_proto(tool: FunctionTool) -> chat_pb2.Tool:
    """A tool as the tokenizer renders it: `strict` and the key order reach the prompt."""
    return chat_pb2.Tool(
        name=tool.name,
        description=tool.description,
        parameters=tool.parameters,
        strict=tool.strict,
        function_keys=tool.keys,
    )


def tokenize_request(request: ValidRequest) -> tokenizer_pb2.TokenizeRequest:
    """The tokenizer's request for a text prompt, or for messages through the chat template."""
    if request.prompt_field != "messages":
        return tokenizer_pb2.TokenizeRequest(text=request.prompt)
    proto = tokenizer_pb2.TokenizeRequest(
        messages=chat_messages(request.messages),
        add_generation_prompt=True,
        allow_special_tokens=request.allow_special_tokens,
        tools=[tool_proto(t) for t in request.tools],
    )
    if request.enable_thinking is not None:
        proto.enable_thinking = request.enable_thinking
    return proto


def chat_messages(turns: tuple[ChatTurn, ...]) -> list[chat_pb2.ChatMessage]:
    messages = []
    for t in turns:
        message = chat_pb2.ChatMessage(
            role=t.role,
            content=t.content,
            tool_calls=[
                chat_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in t.tool_calls
            ],
            tool_call_id=t.tool_call_id,
        )
        if t.reasoning_content is not None:
            message.reasoning_content = t.reasoning_content
        messages.append(message)
    return messages


def decode_request(
    ids: RequestIds,
    prompt: Prompt,
    prefill_layout: kv_pb2.KvLayout,
    kv_lease_ms: int,
    priority: int,
) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(
        request_id=ids.request_id,
        client_request_id=ids.client_request_id,
        prompt_token_ids=prompt.token_ids,
        sampling=sampling_params_to_proto(prompt.sampling),
        prefill_layout=prefill_layout,
        kv_lease_ms=kv_lease_ms,
        priority=priority,
    )


def streamed_generate(
    request: decode_pb2.GenerateRequest, timeout_ms: int, trace_context: dict[str, str]
) -> decode_pb2.StreamedGenerate:
    return decode_pb2.StreamedGenerate(
        request=request, timeout_ms=timeout_ms, trace_context=trace_context
    )


def streamed_event(event: decode_pb2.StreamedEvent, kind: str | None) -> Admitted | Tokens | None:
    """A GenerateStream event that is not an error (`kind`: its oneof's); None for a kind this
    version does not know."""
    if kind == "tokens":
        return _tokens(event.tokens)
    if kind == "admitted":
        return _admitted(event.admitted)
    return None


def _admitted(admitted: decode_pb2.Admitted) -> Admitted:
    return Admitted(
        list(admitted.prompt_block_ids),
        admitted.transfer_token,
        admitted.num_cached_blocks,
    )


def _tokens(tokens: decode_pb2.Tokens) -> Tokens:
    # Once per request and decode step: the empty and unset fields cost nothing here.
    logprobs = tokens.logprobs
    return Tokens(
        list(tokens.token_ids),
        [logprobs_from_proto(lp) for lp in logprobs] if logprobs else [],
        finish_reason_from_proto(tokens.finish_reason) if tokens.finish_reason else None,
    )


def prefill_request(
    ids: RequestIds, prompt: Prompt, decode_address: str, admitted: Admitted
) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=ids.request_id,
        client_request_id=ids.client_request_id,
        prompt_token_ids=prompt.token_ids,
        sampling=sampling_params_to_proto(prompt.sampling),
        destination=prefill_pb2.KvDestination(
            address=decode_address,
            prompt_block_ids=admitted.prompt_block_ids,
            transfer_token=admitted.transfer_token,
            num_cached_blocks=admitted.num_cached_blocks,
        ),
    )


def prefill_stats(reply: prefill_pb2.PrefillResponse) -> PrefillStats:
    return PrefillStats(
        queue_ms=reply.queue_ms,
        compute_ms=reply.compute_ms,
        transfer_ms=reply.transfer_ms,
        kv_bytes=reply.kv_bytes,
        num_cached_tokens=reply.num_cached_tokens,
        prompt_logprobs=[logprobs_from_proto(lp) for lp in reply.prompt_logprobs],
    )


_KINDS = {
    "prefill": generation_pb2.INSTANCE_KIND_PREFILL,
    "decode": generation_pb2.INSTANCE_KIND_DECODE,
}
_STATES = {
    State.UP: generation_pb2.INSTANCE_STATE_UP,
    State.DOWN: generation_pb2.INSTANCE_STATE_DOWN,
    State.DRAINING: generation_pb2.INSTANCE_STATE_DRAINING,
}


def instance(member: Member, target: str) -> generation_pb2.Instance:
    """One router member as Info reports it (`target`: the --prefill/--decode entry)."""
    return generation_pb2.Instance(
        kind=_KINDS[member.kind],
        address=member.address,
        state=_STATES[member.state],
        target=target,
        num_in_flight=member.num_in_flight,
    )
