"""A chat generation's text -> its reasoning, its answer and its tool calls: one implementation
for the gRPC and the HTTP API.

    delta.text ─▶ ReasoningSplitter ─reasoning────────────────────────────▶ reasoning
                        └──────────content─▶ ToolCallParser ─content──────▶ content
                                               (tools offered and        └─calls─▶ tool_calls
                                                tool_choice not none)

Fed a generation's deltas in order (plain, or merged by the coalescer: any cut of the text gives
the same result), it says per delta what may be sent now: text that could still be part of a
tag is held back until the next delta settles it, and a call comes out whole once its block
closes. Prompt requests (not chat) are not split: their callers get the text as generated.

Finish reason: a generation that stopped (`stop`) after making calls ends in `tool_calls`, as
OpenAI's API says; one cut short (`length`) keeps its reason, and the calls it completed. Under
tool_choice required or named the answer can only be calls: a call cut short is dropped, never
content (vLLM clears the content of a forced choice too), so such an answer has no content.
Pure Python, per delta.
"""

from __future__ import annotations

from typing import NamedTuple

from mili.engine.stop import FinishReason
from services.frontend.reasoning import ReasoningSplitter, ThinkFirstSplitter
from services.frontend.tool_calls import ToolCallDelta, ToolCallParser, new_call_id
from services.frontend.validation import ValidRequest

TOOL_CALLS = "tool_calls"  # OpenAI's finish reason for an answer that is calls


class OutputPiece(NamedTuple):
    reasoning: str  # thinking text to send now; may be ""
    content: str  # answer text to send now; may be ""
    tool_calls: list[ToolCallDelta]  # calls completed by this delta; usually []


class ChatOutput:
    """One chat generation's output, delta by delta. `is_parsing_tools`: the request offered
    tools and tool_choice is not none; `is_parallel` False (parallel_tool_calls false): its
    first call only, as vLLM answers it (under tool_choice auto nothing else stops a second);
    `is_forced` (tool_choice required or named): a call the generation's end cut is dropped."""

    def __init__(
        self,
        is_parsing_tools: bool,
        *,
        is_parallel: bool = True,
        is_thinking: bool = True,
        is_forced: bool = False,
        is_constrained: bool = False,
    ) -> None:
        # Without thinking, a "<think>" the model writes is the answer's text; under a
        # constraint only a block at the start is thinking (reasoning.ThinkFirstSplitter).
        self._splitter: ReasoningSplitter | ThinkFirstSplitter | None = None
        if is_thinking:
            self._splitter = ThinkFirstSplitter() if is_constrained else ReasoningSplitter()
        self._tools = (
            ToolCallParser(new_call_id, drops_cut_call=is_forced) if is_parsing_tools else None
        )
        self._max_calls = None if is_parallel else 1
        self._num_sent = 0

    @property
    def num_calls(self) -> int:
        return 0 if self._tools is None else self._tools.num_calls

    def push(
        self, text: str, is_last: bool = False, *, starts_in_reasoning: bool = False
    ) -> OutputPiece:
        """What `text` (the next delta's) completes; `is_last`: the generation ended with it,
        and whatever was held back comes out too; `starts_in_reasoning` (the first delta's):
        the prompt opened a think block, so the text begins as reasoning."""
        if starts_in_reasoning and self._splitter is not None:
            self._splitter.is_reasoning = True
        reasoning, content = ("", text) if self._splitter is None else self._splitter.push(text)
        if is_last and self._splitter is not None:
            rest_reasoning, rest_content = self._splitter.finish()
            reasoning += rest_reasoning
            content += rest_content
        if self._tools is None:
            return OutputPiece(reasoning, content, [])
        parsed = self._tools.push(content) if content else None
        content, calls = (parsed.content, parsed.tool_calls) if parsed else ("", [])
        if is_last:
            rest = self._tools.finish()
            content += rest.content
            calls = [*calls, *rest.tool_calls]
        if self._max_calls is not None:
            calls = calls[: max(0, self._max_calls - self._num_sent)]
        self._num_sent += len(calls)
        return OutputPiece(reasoning, content, calls)

    @classmethod
    def of(cls, valid: ValidRequest) -> ChatOutput:
        """A chat request's splitter. It splits thinking off unless none can come (thinking
        off: enable_thinking false). Under a constraint (a caller's: response_format, a
        regex...; or a forced tool choice's) with thinking on, the grammar allows one think
        block at the start of the output, then the constrained answer
        (mili.engine.constraint.think, `reasoning.think_block`): that block alone is split
        off, and the content is the answer as generated: a "<think>" inside it, a JSON
        string's say, is its text."""
        return cls(
            valid.is_parsing_tools,
            is_parallel=valid.parallel_tool_calls,
            is_thinking=valid.enable_thinking is not False,
            is_forced=valid.tool_choice.is_forced,
            is_constrained=valid.sampling.constraint is not None,
        )

    def finish_reason(self, reason: FinishReason) -> str:
        """The generation's finish reason as the APIs say it: `tool_calls` when it stopped
        after making calls."""
        if reason is FinishReason.STOP and self.num_calls:
            return TOOL_CALLS
        return str(reason)
