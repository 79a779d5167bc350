"""gRPC edge of the tokenizer service: proto <-> domain, limits, and nothing else."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from mili.errors import InvalidArgument, count_of
from mili.pb.common.v1 import chat_pb2, sampling_pb2
from mili.pb.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mili.rpc.policy import REQUEST_FIELDS_BYTES, Policy, uint32s_bytes
from mili.rpc.server import RpcServer
from mili.text.detokenizer import IncrementalDetokenizer
from services.tokenizer.chat_template import Message
from services.tokenizer.tokenizer import ModelTokenizer
from services.tokenizer.tools import Tool, ToolCall

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name


@dataclass(frozen=True)
class TokenizerLimits:
    # Largest text (or sum of chat message contents) accepted, in characters. Qwen3's 40960-token
    # context is ~160k characters of English; the default leaves room for longer contexts.
    max_input_chars: int = 1_000_000
    # Most token ids in one Detokenize / DetokenizeStream message, and most messages in a chat
    # to Tokenize (each renders to a few tokens at least: its role's tags).
    max_token_ids: int = 262_144

    def __post_init__(self) -> None:
        if self.max_input_chars <= 0:
            raise ValueError(f"--max-input-chars must be > 0, got {self.max_input_chars}")
        if self.max_token_ids <= 0:
            raise ValueError(f"--max-token-ids must be > 0, got {self.max_token_ids}")


def _messages(protos: list[chat_pb2.ChatMessage]) -> list[Message]:
    return [
        Message(
            role=m.role,
            content=m.content,
            reasoning_content=m.reasoning_content if m.HasField("reasoning_content") else None,
            tool_calls=tuple(
                ToolCall.parse(c.id, c.name, c.arguments, f"messages[{i}].tool_calls[{j}]")
                for j, c in enumerate(m.tool_calls)
            ),
            tool_call_id=m.tool_call_id,
        )
        for i, m in enumerate(protos)
    ]


def _tools(protos: list[chat_pb2.Tool]) -> list[Tool]:
    return [
        Tool.parse(
            t.name,
            t.description,
            t.parameters,
            f"tools[{i}]",
            strict=t.strict if t.HasField("strict") else None,
            keys=tuple(t.function_keys),
        )
        for i, t in enumerate(protos)
    ]


def _message_chars(messages: list[chat_pb2.ChatMessage]) -> int:
    """Characters of every text the messages carry (tool calls and ids included)."""
    total = 0
    for m in messages:
        total += len(m.content) + len(m.reasoning_content) + len(m.tool_call_id)
        total += sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.tool_calls)
    return total


def _tool_chars(tools: list[chat_pb2.Tool]) -> int:
    return sum(len(t.name) + len(t.description) + len(t.parameters) for t in tools)


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, tokenizer: ModelTokenizer, limits: TokenizerLimits) -> None:
        self._tokenizer = tokenizer
        self._limits = limits

    @property
    def limits(self) -> TokenizerLimits:
        return self._limits

    def _check_chars(self, field: str, num_chars: int) -> None:
        if num_chars > self._limits.max_input_chars:
            raise InvalidArgument(
                field,
                count_of(num_chars, "character"),
                f"longer than the limit of {self._limits.max_input_chars} characters",
            )

    def _check_count(self, field: str, count: int, what: str) -> None:
        """Checked on the protobuf container (O(1)), before any item is converted."""
        if count > self._limits.max_token_ids:
            raise InvalidArgument(
                field,
                f"{count} {what}",
                f"more than the limit of {self._limits.max_token_ids} {what} per message",
            )

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        if request.messages:
            self._check_count("messages", len(request.messages), "messages")
            if request.text:
                raise InvalidArgument(
                    "text",
                    count_of(len(request.text), "character"),
                    "set either text or messages, not both",
                )
            self._check_count("tools", len(request.tools), "tools")
            # Counted on the wire form, before any JSON is parsed: a huge schema is refused
            # unread. Messages and tools share the one budget.
            num_chars = _message_chars(list(request.messages))
            self._check_chars("messages", num_chars)
            self._check_chars("tools", num_chars + _tool_chars(list(request.tools)))
            # Parsing tools' and calls' JSON takes milliseconds for big schemas: off the loop.
            messages, tools = await asyncio.to_thread(
                lambda: (_messages(list(request.messages)), _tools(list(request.tools)))
            )
            add_generation_prompt = (
                request.add_generation_prompt if request.HasField("add_generation_prompt") else True
            )
            enable_thinking = (
                request.enable_thinking if request.HasField("enable_thinking") else None
            )
            # Rendering and encoding a long conversation take milliseconds: off the event loop.
            prompt, token_ids = await asyncio.to_thread(
                self._tokenizer.tokenize_chat,
                messages,
                add_generation_prompt,
                enable_thinking,
                tools=tools,
                allow_special_tokens=request.allow_special_tokens,
            )
        elif request.tools:
            raise InvalidArgument(
                "tools", f"{len(request.tools)} tools", "tools need a chat: set messages"
            )
        elif request.text:
            self._check_chars("text", len(request.text))
            prompt = request.text
            # Encoding a long text takes milliseconds: keep it off the event loop.
            token_ids = await asyncio.to_thread(self._tokenizer.encode, prompt)
        else:
            # `{}` is a caller's mistake (a misspelt field, say), not a request for no tokens.
            raise InvalidArgument("text", "", "empty: set exactly one of text and messages")
        return tokenizer_pb2.TokenizeResponse(token_ids=token_ids, prompt=prompt)

    async def Detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.DetokenizeResponse:
        self._check_count("token_ids", len(request.token_ids), "ids")
        token_ids = list(request.token_ids)
        self._tokenizer.check_ids(token_ids)
        text = await asyncio.to_thread(
            self._tokenizer.decode, token_ids, request.skip_special_tokens
        )
        return tokenizer_pb2.DetokenizeResponse(text=text)

    async def DetokenizeStream(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeStreamResponse]:
        detokenizer: IncrementalDetokenizer | None = None
        async for request in request_iterator:
            if detokenizer is None:
                skip = request.skip_special_tokens
                detokenizer = IncrementalDetokenizer(
                    lambda ids, skip=skip: self._tokenizer.decode(ids, skip)  # type: ignore[misc]
                )
            self._check_count("token_ids", len(request.token_ids), "ids")
            token_ids = list(request.token_ids)
            self._tokenizer.check_ids(token_ids)
            text = detokenizer.push(token_ids)
            if request.final:
                yield tokenizer_pb2.DetokenizeStreamResponse(text=text + detokenizer.flush())
                # Wait for the caller's half-close: a message after `final` would otherwise be
                # dropped unseen, and with it whatever ids it carried.
                async for _ in request_iterator:
                    raise InvalidArgument(
                        "final", True, "a message came after the one marked final: it must be last"
                    )
                return
            yield tokenizer_pb2.DetokenizeStreamResponse(text=text)

    async def Info(
        self, request: tokenizer_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.InfoResponse:
        tok = self._tokenizer
        return tokenizer_pb2.InfoResponse(
            model=tok.model_name,
            vocab_size=tok.vocab_size,
            special_tokens=[
                tokenizer_pb2.SpecialToken(content=t.content, id=t.id) for t in tok.special_tokens
            ],
            eos_token_ids=tok.eos_token_ids,
            chat_template_source=tok.chat_template.source,
            max_input_chars=self._limits.max_input_chars,
            max_token_ids=self._limits.max_token_ids,
            tokenizer_file_sha256=tok.file_sha256,
            sampling_defaults=sampling_pb2.SamplingParams(**tok.sampling_defaults),
        )

    async def GetTokenizerFile(
        self, request: tokenizer_pb2.GetTokenizerFileRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.GetTokenizerFileResponse:
        tok = self._tokenizer
        return tokenizer_pb2.GetTokenizerFileResponse(
            tokenizer_json=tok.file_bytes, sha256=tok.file_sha256
        )


def add_to_server(server: RpcServer, servicer: TokenizerServicer) -> None:
    """Register TokenizerService with its request limits: text (or chat contents) of
    max_input_chars characters of up to 4 bytes of UTF-8, plus up to max_token_ids chat
    messages' framing (tags, lengths, a role: under 32 bytes each); max_token_ids ids to
    detokenize. Info and GetTokenizerFile take a few bytes."""
    limits = servicer.limits
    tokenize = 4 * limits.max_input_chars + 32 * limits.max_token_ids
    detokenize = uint32s_bytes(limits.max_token_ids) + REQUEST_FIELDS_BYTES
    policy = Policy(
        max_request_bytes={
            "Tokenize": tokenize + REQUEST_FIELDS_BYTES,
            "Detokenize": detokenize,
            "DetokenizeStream": detokenize,
        }
    )
    server.add_service(
        SERVICE_NAME,
        lambda s: tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, s),
        policy,
    )
