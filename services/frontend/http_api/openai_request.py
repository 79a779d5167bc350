"""OpenAI request bodies -> the frontend's RequestInput, with OpenAI's parameter names.

    POST /v1/completions        prompt: a string, an array of strings, an array of token ids,
                                or an array of arrays of ids (a batch: one RequestInput each)
    POST /v1/chat/completions   messages: role + content (a string or text parts), assistant
                                tool calls and tool results; tools, tool_choice
                                (openai_messages.py, openai_tools.py); reasoning_effort "none" or
                                chat_template_kwargs.enable_thinking false: no thinking
    both                        response_format, guided_* / structured_outputs: one
                                Constraint (openai_constraint.py); vLLM's prompt_logprobs

Types are checked here (body.py); ranges and limits by the same validation the gRPC API runs
(validation.py), whose field names (`sampling.top_p`, `token_ids[3]`) `param_of` maps back to
the names the caller wrote. Unknown fields are ignored, as OpenAI's API does; fields we know
and do not do (`suffix`, `functions`, ...) are refused naming them, rather than
silently answered as if done.

`response_format`, the `guided_*` extras and `structured_outputs` become the one constraint of
SamplingInput (openai_constraint.py), enforced where prefill and decode sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mili.engine.constraint.spec import KINDS, field_of
from mili.engine.sampling_params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from mili.errors import FieldViolation, InvalidArgument, count_of
from services.frontend.http_api import openai_tools
from services.frontend.http_api.body import Body, is_int
from services.frontend.http_api.errors import ParamOf
from services.frontend.http_api.openai_constraint import Requested, constraint_of
from services.frontend.http_api.openai_messages import messages_of
from services.frontend.validation import (
    Counts,
    RequestInput,
    SamplingInput,
    check_counts,
)

# Each choice is a generation of its own, counted against --max-concurrent-requests; OpenAI
# allows n up to 128, and lm-eval batches up to its batch_size prompts in one request.
MAX_N = 128  # choices per prompt
MAX_CHOICES = 256  # prompts x n in one request
# max_tokens of a completion that leaves it unset: OpenAI's documented default for this
# endpoint, kept by vLLM and SGLang, within the server's --max-tokens-limit and the room the
# prompt leaves (a chat's unset max_tokens is the server's default: the room the context
# leaves).
COMPLETION_MAX_TOKENS = 16
# OpenAI's reasoning efforts (chat's reasoning_effort, the Responses API's reasoning.effort)
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass(frozen=True)
class OpenAIRequest:
    """One request to either endpoint, read; `inputs` holds one RequestInput per prompt."""

    model: str | None  # None: the served one
    inputs: tuple[RequestInput, ...]
    n: int = 1
    is_stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    # vLLM's stream_options.continuous_usage_stats: every chunk with the usage so far too
    is_continuous_usage: bool = False
    echo: bool = False  # completions: the prompt's text before each choice's
    # completions, max_tokens 0 with echo (how lm-eval scores a prompt): the prompt alone, with
    # its logprobs if asked; one token is generated (prefill's) and not returned
    is_prompt_only: bool = False
    is_chat_logprobs: bool = False  # chat: logprobs=true (top_logprobs in sampling.logprobs)
    # vLLM's prompt_logprobs k: each prompt token's logprob and rank with the k most likely at
    # its position, in vLLM's format (completions: each choice's; chat: the response's); never
    # streamed. Completions with echo and logprobs and without it: logprobs (as vLLM).
    prompt_logprobs: int | None = None
    user: str | None = None
    param_of: ParamOf = lambda field: field  # a validation field -> this request's parameter


# A known field we do not do -> whether its value is one we can honour anyway (the default).
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: v == "",
    "skip_special_tokens": lambda v: v is True,
    "include_stop_str_in_output": lambda v: v is False,
    "use_beam_search": lambda v: v is False,
    "functions": lambda v: v == [],  # the deprecated spelling of tools
}


# vLLM's chat extras that would change the prompt or the answer: refused, never ignored.
_UNSUPPORTED_IN_CHAT: dict[str, Callable[[Any], bool]] = {
    "add_generation_prompt": lambda v: v is True,
    "continue_final_message": lambda v: v is False,
    "chat_template": lambda v: False,  # the model's own template only
    "documents": lambda v: False,
    "echo": lambda v: v is False,
}


def _check_unsupported(body: Body, unsupported: dict[str, Callable[[Any], bool]]) -> None:
    for key, is_harmless in unsupported.items():
        value = body.raw(key)
        if value is not None and not is_harmless(value):
            raise InvalidArgument(key, value, "not supported by this server")


def completion_request(body: Body, window: int | None, client_id: str) -> OpenAIRequest:
    """POST /v1/completions' body; InvalidArgument naming the first bad parameter."""
    _check_unsupported(body, _UNSUPPORTED)
    if body.array("tools"):
        raise InvalidArgument("tools", body.raw("tools"), "tools need a chat: /v1/chat/completions")
    requested = constraint_of(body)
    n = _n(body)
    best_of = body.integer("best_of")
    if best_of is not None and best_of != n:
        raise InvalidArgument("best_of", best_of, f"not supported unless equal to n ({n})")
    echo = body.flag("echo") or False
    logprobs = _completion_logprobs(body)
    is_stream = _is_stream(body)
    include_usage, is_continuous_usage = _usage_options(body)
    prompt_logprobs = _prompt_logprobs(body, is_stream)
    max_tokens = body.integer("max_tokens")
    is_prompt_only = max_tokens == 0 and echo
    if max_tokens == 0 and not echo:
        raise InvalidArgument("max_tokens", 0, "must be >= 1 (0 only with echo: the prompt alone)")
    sampling = _sampling(body, 1 if is_prompt_only else max_tokens, logprobs, requested)
    sampling = replace(sampling, default_max_tokens=COMPLETION_MAX_TOKENS)
    if is_prompt_only and sampling.min_tokens:
        raise InvalidArgument("min_tokens", sampling.min_tokens, "must be 0 with max_tokens 0")
    if echo and logprobs is not None:
        # The echoed prompt's tokens get theirs too: prefill computes them when asked (as many
        # top ones as either needs; each takes its own).
        sampling = replace(sampling, prompt_logprobs=max(logprobs, prompt_logprobs or 0))
        if prompt_logprobs is None and not is_stream:
            prompt_logprobs = logprobs  # vLLM answers prompt_logprobs here too
    elif prompt_logprobs is not None:
        sampling = replace(sampling, prompt_logprobs=prompt_logprobs)
    prompts = _prompts(body)
    if len(prompts) * n > MAX_CHOICES:
        if n == 1:  # the prompts alone are too many: name them, not an n the client never set
            raise InvalidArgument(
                "prompt", f"{len(prompts)} prompts", f"over this server's {MAX_CHOICES} choices"
            )
        raise InvalidArgument(
            "n", n, f"{len(prompts)} prompts x n is over this server's {MAX_CHOICES} choices"
        )
    inputs = []
    for prompt in prompts:
        text, ids = (prompt, ()) if isinstance(prompt, str) else ("", prompt)
        counts = Counts(
            len(ids), 0, len(sampling.stop), len(sampling.stop_token_ids), len(sampling.logit_bias)
        )
        _check_counts(counts, window, _completion_param)
        inputs.append(
            RequestInput(
                client_request_id=client_id,
                prompt=text,
                token_ids=ids,
                sampling=sampling,
                priority=_priority(body),
            )
        )
    return OpenAIRequest(
        model=body.text("model"),
        inputs=tuple(inputs),
        n=n,
        is_stream=is_stream,
        include_usage=include_usage,
        is_continuous_usage=is_continuous_usage,
        echo=echo,
        is_prompt_only=is_prompt_only,
        prompt_logprobs=prompt_logprobs,
        user=body.text("user"),
        param_of=_with_constraint(_completion_param, requested),
    )


def chat_request(body: Body, window: int | None, client_id: str) -> OpenAIRequest:
    """POST /v1/chat/completions' body; InvalidArgument naming the first bad parameter."""
    _check_unsupported(body, _UNSUPPORTED | _UNSUPPORTED_IN_CHAT)
    n = _n(body)
    is_logprobs = body.flag("logprobs") or False
    top = body.integer("top_logprobs")
    if top and not is_logprobs:  # 0 asks for nothing: harmless without logprobs
        raise InvalidArgument("top_logprobs", top, "needs logprobs set to true")
    max_key = "max_completion_tokens" if body.has("max_completion_tokens") else "max_tokens"
    tool_choice = openai_tools.tool_choice_of(body)
    requested = constraint_of(body, tool_choice)
    sampling = _sampling(
        body, body.integer(max_key), (top or 0) if is_logprobs else None, requested
    )
    prompt_logprobs = _prompt_logprobs(body, _is_stream(body))
    if prompt_logprobs is not None:
        sampling = replace(sampling, prompt_logprobs=prompt_logprobs)
    include_usage, is_continuous_usage = _usage_options(body)
    messages = messages_of(body)
    counts = Counts(
        0, len(messages), len(sampling.stop), len(sampling.stop_token_ids), len(sampling.logit_bias)
    )
    _check_counts(counts, window, _common_param)
    enable_thinking = _enable_thinking(body)

    def param_of(field: str) -> str:
        if field == "sampling.logprobs":
            return "top_logprobs"
        if field == "sampling.max_tokens":
            return max_key
        return openai_tools.param(field) or _common_param(field)

    chat = RequestInput(
        client_request_id=client_id,
        messages=messages,
        sampling=sampling,
        enable_thinking=enable_thinking,
        tools=openai_tools.tools_of(body),
        tool_choice=tool_choice,
        parallel_tool_calls=openai_tools.parallel_of(body),
        priority=_priority(body),
    )
    return OpenAIRequest(
        model=body.text("model"),
        inputs=(chat,),
        n=n,
        is_stream=_is_stream(body),
        include_usage=include_usage,
        is_continuous_usage=is_continuous_usage,
        is_chat_logprobs=is_logprobs,
        prompt_logprobs=prompt_logprobs,
        user=body.text("user"),
        param_of=_with_constraint(param_of, requested),
    )


def with_seed(request: RequestInput, seed: int | None) -> RequestInput:
    """`request` drawing from `seed` (choice i of n draws from the caller's seed + i)."""
    return replace(request, sampling=replace(request.sampling, seed=seed))


def nth_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice `i`: the caller's + i (kept in 64 bits), or None (a fresh one each).
    A seed outside 64 bits stays as it is, for validation to name."""
    if seed is None or not 0 <= seed < 2**64:
        return seed
    return (seed + i) % 2**64


def _check_counts(counts: Counts, window: int | None, param_of: ParamOf) -> None:
    """validation.check_counts, its errors naming this request's parameters."""
    try:
        check_counts(counts, window)
    except InvalidArgument as exc:
        mapped = [FieldViolation(param_of(v.field), v.description) for v in exc.violations]
        raise InvalidArgument.many(mapped) from None


# ---- fields ------------------------------------------------------------------------------------


def _enable_thinking(body: Body) -> bool | None:
    """chat_template_kwargs.enable_thinking, or false for OpenAI's reasoning_effort "none".
    Qwen3 has no thinking budget: any other effort thinks as the model does. LiteLLM sends
    reasoning_effort (its one way to turn reasoning off across providers); vLLM hands it to
    the chat template, which Qwen3's ignores, and the model thinks anyway."""
    kwargs = body.object("chat_template_kwargs")
    enable_thinking = None if kwargs is None else kwargs.flag("enable_thinking")
    effort = body.text("reasoning_effort")
    if effort is not None and effort not in _EFFORTS:
        raise InvalidArgument("reasoning_effort", effort, f"must be one of {', '.join(_EFFORTS)}")
    if effort != "none":
        return enable_thinking
    if enable_thinking:
        reason = "none turns thinking off, which chat_template_kwargs.enable_thinking turns on"
        raise InvalidArgument("reasoning_effort", effort, reason)
    return False


def _n(body: Body) -> int:
    n = body.integer("n")
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise InvalidArgument("n", n, f"must be in [1, {MAX_N}]")
    return n


def _is_stream(body: Body) -> bool:
    return body.flag("stream") or False


def _prompt_logprobs(body: Body, is_stream: bool) -> int | None:
    """vLLM's prompt_logprobs: k in [0, 20], the limit of `logprobs` (vLLM's default
    --max-logprobs is the same 20). Its -1, the whole vocabulary, is over that limit, as vLLM
    finds it by default; with stream a k > 0 is refused, as vLLM refuses it (no chunk would
    carry them), and 0 is answered with nothing, as vLLM answers it."""
    k = body.integer("prompt_logprobs")
    if k is None:
        return None
    if k == -1:
        reason = f"-1 (the whole vocabulary) is over this server's limit of {MAX_TOP_LOGPROBS}"
        raise InvalidArgument("prompt_logprobs", k, reason)
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("prompt_logprobs", k, f"must be in [0, {MAX_TOP_LOGPROBS}]")
    if is_stream:
        if k > 0:
            raise InvalidArgument("prompt_logprobs", k, "not available with stream: true")
        return None
    return k


def _usage_options(body: Body) -> tuple[bool, bool]:
    """stream_options as vLLM reads them: (include_usage, continuous_usage_stats). Given
    stream_options, include_usage is on unless set false (vLLM's default; OpenAI's is off);
    continuous_usage_stats, a vLLM extra that load generators send (guidellm always, aiperf
    --per-chunk-usage, to count the tokens of the chunk that ends TTFT), needs it."""
    options = body.object("stream_options")
    if options is None:
        return False, False
    if not _is_stream(body):
        raise InvalidArgument("stream_options", options.data, "only allowed with stream: true")
    include_usage = options.flag("include_usage") is not False
    return include_usage, include_usage and bool(options.flag("continuous_usage_stats"))


def _sampling(
    body: Body,
    max_tokens: int | None,
    logprobs: int | None,
    requested: Requested | None,
) -> SamplingInput:
    """The sampling parameters both endpoints share, as sent; ranges are validation's."""
    return SamplingInput(
        constraint=None if requested is None else requested.constraint,
        max_tokens=max_tokens,
        temperature=body.number("temperature"),
        top_p=body.number("top_p"),
        top_k=_top_k(body),
        min_p=body.number("min_p"),
        repetition_penalty=body.number("repetition_penalty"),
        presence_penalty=body.number("presence_penalty"),
        frequency_penalty=body.number("frequency_penalty"),
        seed=_seed(body),
        stop=body.texts("stop"),
        stop_token_ids=body.integers("stop_token_ids"),
        ignore_eos=body.flag("ignore_eos") or False,
        min_tokens=_min_tokens(body),
        logit_bias=_logit_bias(body),
        logprobs=logprobs,
    )


def _logit_bias(body: Body) -> tuple[tuple[int, float], ...]:
    """logit_bias: {"token id": bias} (JSON keys are strings) -> (id, bias) pairs; the ranges
    are SamplingParams' and the vocabulary's. Counted before any entry is read (the body may
    hold megabytes of them); validation counts the gRPC API's the same way."""
    bias = body.object("logit_bias")
    if bias is None:
        return ()
    if len(bias.data) > MAX_LOGIT_BIAS:
        raise InvalidArgument(
            "logit_bias",
            count_of(len(bias.data), "item"),
            f"more entries than this server's limit of {MAX_LOGIT_BIAS}",
        )
    pairs = []
    for key in bias.data:
        if not (key.isascii() and key.isdigit() and len(key) <= 19):
            raise InvalidArgument(bias.name(key), key, "keys must be token ids (decimal)")
        value = bias.number(key)
        if value is None:
            raise bias.wrong(key, None, "a number")
        pairs.append((int(key), value))
    return tuple(sorted(pairs))


def _priority(body: Body) -> int:
    """vLLM's priority: unset is 0, a lower number is admitted first; the range is validation's."""
    n = body.integer("priority")
    return 0 if n is None else n


def _min_tokens(body: Body) -> int:
    """min_tokens (vLLM's extra): unset is 0; the range is SamplingParams'."""
    n = body.integer("min_tokens")
    return 0 if n is None else n


def _completion_logprobs(body: Body) -> int | None:
    """A completion's logprobs k. `true` is 1, as vLLM's pydantic reads a boolean there (evalscope
    perf --logprobs sends the chat API's `true` to both endpoints); `false` asks for none, as in
    the chat API."""
    if body.raw("logprobs") is True:
        return 1
    if body.raw("logprobs") is False:
        return None
    return body.integer("logprobs")


def _seed(body: Body) -> int | None:
    """seed: any 64-bit integer, as vLLM takes it; a negative one is its two's complement (the
    gRPC seed is a uint64), so -1 is 2^64 - 1. Out of 64 bits, SamplingParams names it."""
    seed = body.integer("seed")
    return seed % 2**64 if seed is not None and -(2**63) <= seed < 0 else seed


def _top_k(body: Body) -> int | None:
    """top_k: -1 means off in vLLM's API, 0 in ours."""
    top_k = body.integer("top_k")
    return 0 if top_k == -1 else top_k


def _prompts(body: Body) -> list[str | tuple[int, ...]]:
    """`prompt` as a list of prompts: text or token ids each."""
    prompt = body.raw("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(is_int(p) for p in prompt):
            return [body.integers("prompt")]
        if all(isinstance(p, list) for p in prompt):
            for i, ids in enumerate(prompt):
                if not ids or not all(is_int(t) for t in ids):
                    raise InvalidArgument("prompt", ids, f"prompt[{i}]: not an array of token ids")
            return [tuple(ids) for ids in prompt]
    raise InvalidArgument(
        "prompt",
        prompt,
        "must be a non-empty string, array of strings, array of token ids or array of arrays "
        "of token ids",
    )


# ---- validation's fields -> parameters --------------------------------------------------------


def _common_param(field: str) -> str:
    if field == "request_id":
        return "X-Request-Id"  # the header the id came from
    return field.removeprefix("sampling.")


def _with_constraint(param_of: ParamOf, requested: Requested | None) -> ParamOf:
    """`param_of`, naming a constraint's errors (`sampling.json_schema` once compiled,
    `sampling.choice.choices[2]`) after the parameter it came from (`guided_choice[2]`), or
    `tools` (tool_choice's own constraint)."""
    fields = [field_of(kind) for kind in KINDS]
    where = requested.param if requested is not None else "tools"

    def named(field: str) -> str:
        for own in fields:
            if field == own or field.startswith(f"{own}["):
                return where + field.removeprefix(own)
        return param_of(field)

    return named


def _completion_param(field: str) -> str:
    if field == "token_ids" or field.startswith("token_ids["):
        return "prompt"
    return _common_param(field)
