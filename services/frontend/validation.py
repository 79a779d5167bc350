"""Checking a generation request and filling in every default, in plain Python.

In stages, because the frontend learns what it needs step by step (and a first look at the
request as it came, before any of it is converted):

    check_counts(counts, ...)          the lengths of its lists, before they are converted
    validate(request, limits)          before anything else: shape of the input, sampling ranges
    check_token_ids(ids, vocab_size)   once the tokenizer's vocabulary is known (prompt.py)
    fit_context(sampling, n, context)  once the prompt is tokenized and the context is known
                                       (prompt.py)

Every failure is an `InvalidArgument` whose violations name the request field as a caller writes
it (`sampling.top_p`, `token_ids[3]`), so the gRPC BadRequest details point at what to fix.
The result holds a fully resolved `SamplingParams` (mili.engine.sampling_params, whose own checks
judge every range): prefill and decode never apply a default of their own.
"""

from __future__ import annotations

import dataclasses
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from mili.engine.constraint.spec import Constraint
from mili.engine.constraint.spec import validate as validate_constraint
from mili.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MODEL_DEFAULT_FIELDS,
    OPTIONAL_FIELDS,
    SamplingParams,
)
from mili.errors import FieldViolation, InvalidArgument, count_of
from services.frontend import tools as tool_checks
from services.frontend.tool_grammar import tool_call_constraint
from services.frontend.tools import AUTO, FunctionTool, ToolCallInput, ToolChoice

ROLES = ("system", "user", "assistant", "tool")
_MAX_VIOLATIONS = 16  # a caller fixes a few at a time; the status trailer stays small

PromptField = Literal["prompt", "messages", "token_ids"]

# What the frontend takes beyond SamplingParams' own rules (its MAX_LOGIT_BIAS entries).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_CLIENT_REQUEST_ID_CHARS = 256  # GenerateRequest.request_id
PRIORITIES = range(-(2**31), 2**31)  # GenerateRequest.priority is an int32; HTTP's the same

# The largest context of a Qwen3 model: the bound on a prompt's ids before any decode instance
# reported its own context window.
MAX_CONTEXT_TOKENS = 262_144


@dataclass(frozen=True)
class Limits:
    """What the frontend accepts; see `FrontendConfig` for where each comes from."""

    # None: what the context window (and the largest decode pool) leaves after the prompt, up
    # to max_tokens_limit, as vLLM's default: fitted once the prompt is tokenized
    # (prompt.fit_context shrinks a default max_tokens).
    default_max_tokens: int | None = None
    max_tokens_limit: int | None = None  # None: only the context window bounds max_tokens

    def __post_init__(self) -> None:
        # Both are uint32 fields of Info (an overflow failed every Info call).
        default = self.default_max_tokens
        if default is not None and not 1 <= default < 2**32:
            raise ValueError(f"default_max_tokens must be in [1, 2^32), got {default}")
        limit = self.max_tokens_limit
        if limit is not None and limit >= 2**32:
            raise ValueError(f"max_tokens_limit must be below 2^32, got {limit}")
        if limit is not None and default is not None and limit < default:
            raise ValueError(
                f"max_tokens_limit ({limit}) must be >= default_max_tokens "
                f"({self.default_max_tokens})"
            )


# ---- what the caller sent (None = left unset) --------------------------------------------------


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCallInput, ...] = ()  # assistant turns: the calls it made
    tool_call_id: str = ""  # tool turns: the call whose result this is


@dataclass(frozen=True)
class SamplingInput:
    """SamplingParams as sent: a field the caller left unset is None."""

    max_tokens: int | None = None
    # The API's own default for an unset max_tokens (HTTP completions: OpenAI's 16), within
    # this server's limit; None: the server's default (the room the context leaves).
    default_max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # tokens before a stop may end the generation (0: none)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # of the prompt's tokens: None, 0 or n <= 20 (top-n)
    # Structured output (sampling.json_schema, .regex, ...): sizes checked by `validate`, then
    # compiled once before admission (Generations), so a bad one costs no KV block.
    constraint: Constraint | None = None


@dataclass(frozen=True)
class RequestInput:
    """GenerateRequest (or CompleteRequest) as sent."""

    client_request_id: str = ""  # the request's request_id field: the caller's own label
    prompt: str = ""
    messages: tuple[ChatTurn, ...] = ()
    token_ids: tuple[int, ...] = ()
    sampling: SamplingInput = SamplingInput()
    enable_thinking: bool | None = None
    allow_special_tokens: bool = False  # chat: special-token strings in content stay special
    tools: tuple[FunctionTool, ...] = ()  # chat: functions the model may call
    tool_choice: ToolChoice = AUTO
    parallel_tool_calls: bool = True  # several calls in one answer
    priority: int = 0  # its place among waiting requests: lower goes first (vLLM's sense)


class Counts(NamedTuple):
    """How many items each list of a request holds, counted on the protobuf containers (O(1))."""

    token_ids: int
    messages: int
    stop: int
    stop_token_ids: int
    logit_bias: int = 0


def check_counts(counts: Counts, max_context_tokens: int | None) -> None:
    """Refuse lists longer than any valid request's before any item is converted (a 7.5 MB
    list of ids would take a second and 120 MB as Python ints): a prompt of more ids than the
    context window (`max_context_tokens`, MAX_CONTEXT_TOKENS while unknown), a chat of more
    messages than that (each renders to one token at least), more stop strings or ids than
    this server takes. InvalidArgument naming each such field."""
    context = max_context_tokens or MAX_CONTEXT_TOKENS
    window = f"the context window of {context} tokens"
    violations: list[FieldViolation] = []
    for field, count, limit, reason in (
        ("token_ids", counts.token_ids, context, f"more ids than {window}"),
        (
            "messages",
            counts.messages,
            context,
            f"more messages than {window} (1 token each at least)",
        ),
        ("sampling.stop", counts.stop, MAX_STOP_STRINGS, "more strings than"),
        ("sampling.stop_token_ids", counts.stop_token_ids, MAX_STOP_TOKEN_IDS, "more than"),
        ("sampling.logit_bias", counts.logit_bias, MAX_LOGIT_BIAS, "more entries than"),
    ):
        if count > limit:
            if field.startswith("sampling."):
                reason = f"{reason} this server's limit of {limit}"
            violations.append(FieldViolation.of(field, count_of(count, "item"), reason))
    raise_if_any(violations)


# ---- what goes downstream ----------------------------------------------------------------------


@dataclass(frozen=True)
class ValidRequest:
    client_request_id: str  # the caller's id, or a fresh one: echoed in every response
    prompt_field: PromptField  # which input the caller used; named in prompt-length errors
    prompt: str
    messages: tuple[ChatTurn, ...]
    token_ids: tuple[int, ...]
    # Every field resolved (what prefill and decode receive), but for the model's defaults
    # (prompt.py gives them to `unset_sampling`, known only from the tokenizer's Info).
    sampling: SamplingParams
    enable_thinking: bool | None
    # The caller left max_tokens unset: fit_context may lower it to what the context leaves.
    is_default_max_tokens: bool = False
    # The MODEL_DEFAULT_FIELDS the caller left unset.
    unset_sampling: frozenset[str] = frozenset()
    # Chat: tokenize special-token strings in the messages as special tokens (default: text).
    allow_special_tokens: bool = False
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = AUTO
    parallel_tool_calls: bool = True
    # A choice after the first of an HTTP request with several: the request was taken when its
    # first was, so it waits for room past the admission queue's bounds (http_api/choices.py).
    is_later_choice: bool = False
    priority: int = 0  # lower is admitted first among waiting requests (admission.py)

    @property
    def is_parsing_tools(self) -> bool:
        """The answer's <tool_call> blocks are parsed into calls (chat_output.py)."""
        return bool(self.tools) and self.tool_choice.mode != "none"


def _new_seed() -> int:
    return secrets.randbits(63)


def _new_client_request_id() -> str:
    return uuid.uuid4().hex


def validate(
    request: RequestInput,
    limits: Limits,
    *,
    new_seed: Callable[[], int] = _new_seed,
    new_client_request_id: Callable[[], str] = _new_client_request_id,
) -> ValidRequest:
    """Check everything that needs no other service; raise InvalidArgument naming each bad field.

    An unset seed becomes a fresh random one here, so prefill (first token) and decode (the
    rest) draw from the same seed and the request's log line says how to reproduce it.
    """
    violations: list[FieldViolation] = []

    def bad(field: str, value: object, reason: str) -> None:
        violations.append(FieldViolation.of(field, value, reason))

    if len(request.client_request_id) > MAX_CLIENT_REQUEST_ID_CHARS:
        bad(
            "request_id",
            count_of(len(request.client_request_id), "character"),
            f"longer than {MAX_CLIENT_REQUEST_ID_CHARS} characters",
        )
    prompt_field = _check_input(request, bad)
    if request.priority not in PRIORITIES:
        bad("priority", request.priority, "must fit in 32 bits (a signed integer)")
    tool_checks.check_tools(request.tools, request.tool_choice, bool(request.messages), bad)
    sampling = _resolve_sampling(request.sampling, limits, new_seed, bad, violations)
    raise_if_any(violations)
    assert sampling is not None and prompt_field is not None
    tool_constraint = tool_call_constraint(
        request.tools,
        request.tool_choice,
        is_parallel=request.parallel_tool_calls,
    )
    if tool_constraint is not None:
        if sampling.constraint is not None:
            raise InvalidArgument(
                "tool_choice",
                request.tool_choice.mode,
                "is enforced with a constraint of its own: drop sampling's constraint, or "
                "use tool_choice auto",
            )
        if sampling.min_tokens:
            raise InvalidArgument(
                "sampling.min_tokens",
                sampling.min_tokens,
                f"cannot be combined with tool_choice {request.tool_choice.mode} (enforced "
                "with a constraint, which must be able to end)",
            )
        sampling = dataclasses.replace(sampling, constraint=tool_constraint)
    return ValidRequest(
        client_request_id=request.client_request_id or new_client_request_id(),
        prompt_field=prompt_field,
        prompt=request.prompt,
        messages=request.messages,
        token_ids=request.token_ids,
        sampling=sampling,
        enable_thinking=request.enable_thinking,
        is_default_max_tokens=request.sampling.max_tokens is None,
        unset_sampling=frozenset(
            f for f in MODEL_DEFAULT_FIELDS if getattr(request.sampling, f) is None
        ),
        allow_special_tokens=request.allow_special_tokens,
        tools=request.tools,
        tool_choice=request.tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        priority=request.priority,
    )


Bad = Callable[[str, object, str], None]


def _check_input(request: RequestInput, bad: Bad) -> PromptField | None:
    given: list[PromptField] = []
    if request.prompt:
        given.append("prompt")
    if request.messages:
        given.append("messages")
    if request.token_ids:
        given.append("token_ids")
    if not given:
        bad("prompt", "", "empty: set exactly one of prompt, messages and token_ids")
        return None
    for extra in given[1:]:
        bad(extra, f"{extra} set", f"set exactly one of prompt, messages and token_ids: {given}")
    for i, turn in enumerate(request.messages):
        if turn.role not in ROLES:
            bad(f"messages[{i}].role", turn.role, f"must be one of {', '.join(ROLES)}")
        tool_checks.check_tool_calls(turn.tool_calls, turn.role, f"messages[{i}].tool_calls", bad)
    return given[0]


# Unset fields keep SamplingParams' defaults, except max_tokens (this server's default) and seed
# (a fresh one), resolved below.
_DEFAULTED_FIELDS = tuple(f for f in OPTIONAL_FIELDS if f not in ("max_tokens", "seed"))


def _resolve_sampling(
    s: SamplingInput,
    limits: Limits,
    new_seed: Callable[[], int],
    bad: Bad,
    violations: list[FieldViolation],
) -> SamplingParams | None:
    """The request's SamplingParams with every default filled in. Ranges are SamplingParams'
    own checks; this server's limits (max_tokens, stop strings) are checked here."""
    limit = limits.max_tokens_limit
    if s.max_tokens is not None and limit is not None and s.max_tokens > limit:
        bad("sampling.max_tokens", s.max_tokens, f"must be <= {limit}, this server's limit")
    max_tokens = s.max_tokens
    if max_tokens is None:  # this server's default, or what min_tokens asks for above it
        min_tokens = s.min_tokens if isinstance(s.min_tokens, int) else 0
        default = s.default_max_tokens or limits.default_max_tokens
        if default is None:  # the most there is: fit_context shrinks it to the room left
            default = limit if limit is not None else 2**32 - 1
        elif limit is not None:  # an API's default is no request for more than the limit
            default = min(default, limit)
        max_tokens = max(default, min_tokens)
        if limit is not None and max_tokens > limit:
            bad("sampling.min_tokens", s.min_tokens, f"must be <= {limit}, this server's limit")
    _check_stops(s, bad)
    if s.constraint is not None:
        try:
            validate_constraint(s.constraint)
        except InvalidArgument as err:
            violations.extend(err.violations)
    given = {f: getattr(s, f) for f in _DEFAULTED_FIELDS if getattr(s, f) is not None}
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            seed=new_seed() if s.seed is None else s.seed,
            stop=s.stop,
            stop_token_ids=s.stop_token_ids,
            ignore_eos=s.ignore_eos,
            min_tokens=s.min_tokens,
            logit_bias=s.logit_bias,
            constraint=s.constraint,
            **given,
        )
    except InvalidArgument as err:
        violations.extend(
            FieldViolation(f"sampling.{v.field}", v.description) for v in err.violations
        )
        return None


def _check_stops(s: SamplingInput, bad: Bad) -> None:
    """Each stop string's length; their numbers (and the stop ids') are check_counts', run on
    every request before it is converted."""
    for i, stop in enumerate(s.stop):  # empty ones are SamplingParams' to refuse
        if len(stop) > MAX_STOP_CHARS:
            bad(
                f"sampling.stop[{i}]",
                count_of(len(stop), "character"),
                f"longer than {MAX_STOP_CHARS} characters",
            )


def raise_if_any(violations: list[FieldViolation]) -> None:
    """One InvalidArgument for all of `violations` (the first few), if there are any."""
    if violations:
        raise InvalidArgument.many(violations[:_MAX_VIOLATIONS])
