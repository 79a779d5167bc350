"""Checking a generation request and filling in every default, in plain Python.

Three stages, because the frontend learns what it needs in three steps:

    validate(request, limits)          before anything else: shape of the input, sampling ranges
    check_token_ids(ids, vocab_size)   once the tokenizer's vocabulary is known
    fit_context(sampling, n, context)  once the prompt is tokenized and the context is known

Every failure is an `InvalidArgument` whose violations name the request field as a caller writes
it (`sampling.top_p`, `token_ids[3]`), so the gRPC BadRequest details point at what to fix.
The result is a fully resolved `Sampling`: prefill and decode never apply a default of their own.
"""

from __future__ import annotations

import math
import secrets
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from mili.errors import FieldViolation, InvalidArgument

ROLES = ("system", "user", "assistant", "tool")
MAX_LOGPROBS = 20
MAX_SEED = 2**64  # the proto field is uint64
_MAX_VIOLATIONS = 16  # a caller fixes a few at a time; the status trailer stays small

PromptField = Literal["prompt", "messages", "token_ids"]


@dataclass(frozen=True)
class Limits:
    """What the frontend accepts; see `FrontendConfig` for where each comes from."""

    default_max_tokens: int = 256
    max_tokens_limit: int | None = None  # None: only the context window bounds max_tokens
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    max_stop_token_ids: int = 64
    max_request_id_chars: int = 256

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        limit = self.max_tokens_limit
        if limit is not None and limit < self.default_max_tokens:
            raise ValueError(
                f"max_tokens_limit ({limit}) must be >= default_max_tokens "
                f"({self.default_max_tokens})"
            )
        for name in ("max_stop_strings", "max_stop_chars", "max_stop_token_ids"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


# ---- what the caller sent (None = left unset) --------------------------------------------------


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str
    reasoning_content: str | None = None


@dataclass(frozen=True)
class SamplingInput:
    """SamplingParams as sent: a field the caller left unset is None."""

    max_tokens: int | None = None
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
    logprobs: int | None = None


@dataclass(frozen=True)
class RequestInput:
    """GenerateRequest (or CompleteRequest) as sent."""

    request_id: str = ""
    prompt: str = ""
    messages: tuple[ChatTurn, ...] = ()
    token_ids: tuple[int, ...] = ()
    sampling: SamplingInput = SamplingInput()
    enable_thinking: bool | None = None


# ---- what goes downstream ----------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """Every sampling field resolved; what prefill and decode receive."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None
    # The caller left max_tokens unset: fit_context may lower it to what the context leaves.
    is_default_max_tokens: bool = False


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_field: PromptField  # which input the caller used; named in prompt-length errors
    prompt: str
    messages: tuple[ChatTurn, ...]
    token_ids: tuple[int, ...]
    sampling: Sampling
    enable_thinking: bool | None


def _new_seed() -> int:
    return secrets.randbits(63)


def _new_request_id() -> str:
    return uuid.uuid4().hex


def validate(
    request: RequestInput,
    limits: Limits,
    *,
    new_seed: Callable[[], int] = _new_seed,
    new_request_id: Callable[[], str] = _new_request_id,
) -> ValidRequest:
    """Check everything that needs no other service; raise InvalidArgument naming each bad field.

    An unset seed becomes a fresh random one here, so prefill (first token) and decode (the
    rest) draw from the same seed and the request's log line says how to reproduce it.
    """
    violations: list[FieldViolation] = []

    def bad(field: str, value: object, reason: str) -> None:
        violations.extend(InvalidArgument(field, value, reason).violations)

    if len(request.request_id) > limits.max_request_id_chars:
        bad(
            "request_id",
            f"{len(request.request_id)} characters",
            f"longer than {limits.max_request_id_chars} characters",
        )
    prompt_field = _check_input(request, bad)
    sampling = _resolve_sampling(request.sampling, limits, new_seed, bad)
    _raise_if_any(violations)
    assert sampling is not None and prompt_field is not None
    return ValidRequest(
        request_id=request.request_id or new_request_id(),
        prompt_field=prompt_field,
        prompt=request.prompt,
        messages=request.messages,
        token_ids=request.token_ids,
        sampling=sampling,
        enable_thinking=request.enable_thinking,
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
    return given[0]


def _is_real(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _resolve_sampling(
    s: SamplingInput, limits: Limits, new_seed: Callable[[], int], bad: Bad
) -> Sampling | None:
    def pick(field: str, value: float | None, default: float, ok: bool, reason: str) -> float:
        if value is None:
            return default
        if not (_is_real(value) and ok):
            bad(f"sampling.{field}", value, reason)
        return value

    max_tokens = limits.default_max_tokens if s.max_tokens is None else s.max_tokens
    if s.max_tokens is not None:
        if s.max_tokens < 1:
            bad("sampling.max_tokens", s.max_tokens, "must be >= 1")
        elif limits.max_tokens_limit is not None and s.max_tokens > limits.max_tokens_limit:
            bad(
                "sampling.max_tokens",
                s.max_tokens,
                f"must be <= {limits.max_tokens_limit}, this server's limit",
            )
    t, p, m, r = s.temperature, s.top_p, s.min_p, s.repetition_penalty
    temperature = pick("temperature", t, 1.0, t is not None and t >= 0, "must be >= 0")
    top_p = pick("top_p", p, 1.0, p is not None and 0 < p <= 1, "must be in (0, 1]")
    min_p = pick("min_p", m, 0.0, m is not None and 0 <= m <= 1, "must be in [0, 1]")
    repetition = pick("repetition_penalty", r, 1.0, r is not None and r > 0, "must be > 0")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(s, name)
        penalties[name] = pick(name, v, 0.0, v is not None and -2 <= v <= 2, "must be in [-2, 2]")
    top_k = 0 if s.top_k is None else s.top_k
    if top_k < 0:
        bad("sampling.top_k", top_k, "must be >= 0 (0 = off)")
    if s.logprobs is not None and not 0 <= s.logprobs <= MAX_LOGPROBS:
        bad("sampling.logprobs", s.logprobs, f"must be unset or in [0, {MAX_LOGPROBS}]")
    if s.seed is not None and not 0 <= s.seed < MAX_SEED:
        bad("sampling.seed", s.seed, "must fit in 64 bits")
    _check_stops(s, limits, bad)
    return Sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition,
        presence_penalty=penalties["presence_penalty"],
        frequency_penalty=penalties["frequency_penalty"],
        seed=new_seed() if s.seed is None else s.seed,
        stop=s.stop,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        is_default_max_tokens=s.max_tokens is None,
    )


def _check_stops(s: SamplingInput, limits: Limits, bad: Bad) -> None:
    if len(s.stop) > limits.max_stop_strings:
        bad("sampling.stop", f"{len(s.stop)} strings", f"at most {limits.max_stop_strings}")
    for i, stop in enumerate(s.stop):
        if not stop:
            bad(f"sampling.stop[{i}]", stop, "must not be empty")
        elif len(stop) > limits.max_stop_chars:
            bad(
                f"sampling.stop[{i}]",
                f"{len(stop)} characters",
                f"longer than {limits.max_stop_chars} characters",
            )
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        bad(
            "sampling.stop_token_ids",
            f"{len(s.stop_token_ids)} ids",
            f"at most {limits.max_stop_token_ids}",
        )


def _raise_if_any(violations: list[FieldViolation]) -> None:
    if violations:
        raise InvalidArgument.many(violations[:_MAX_VIOLATIONS])


def check_token_ids(request: ValidRequest, vocab_size: int) -> None:
    """Every id the caller sent (prompt and stop ids) must be below the tokenizer's vocab size."""
    violations: list[FieldViolation] = []
    reason = f"outside the vocabulary (ids 0..{vocab_size - 1})"
    for field, ids in (
        ("token_ids", request.token_ids),
        ("sampling.stop_token_ids", request.sampling.stop_token_ids),
    ):
        for i, token_id in enumerate(ids):
            if not 0 <= token_id < vocab_size:
                violations.extend(InvalidArgument(f"{field}[{i}]", token_id, reason).violations)
    _raise_if_any(violations)


def fit_context(
    sampling: Sampling,
    num_prompt_tokens: int,
    max_context_tokens: int,
    prompt_field: PromptField,
    max_prompt_tokens: int | None = None,
) -> Sampling:
    """Check prompt + max_tokens fits the context window; an unset max_tokens shrinks to fit.

    Raises InvalidArgument naming the prompt (when it alone is too long for prefill, or leaves
    no room for one token) or `sampling.max_tokens`, with the numbers a caller needs to fix it.
    """
    if num_prompt_tokens == 0:
        raise InvalidArgument(prompt_field, "", "tokenizes to no tokens")
    if max_prompt_tokens is not None and num_prompt_tokens > max_prompt_tokens:
        raise InvalidArgument(
            prompt_field,
            f"{num_prompt_tokens} tokens",
            f"too long: prefill accepts at most {max_prompt_tokens} prompt tokens",
        )
    room = max_context_tokens - num_prompt_tokens
    if room < 1:
        raise InvalidArgument(
            prompt_field,
            f"{num_prompt_tokens} tokens",
            f"too long: the context window is {max_context_tokens} tokens, and the prompt "
            "must leave room for at least one generated token",
        )
    if sampling.max_tokens <= room:
        return sampling
    if sampling.is_default_max_tokens:
        return replace(sampling, max_tokens=room)
    raise InvalidArgument(
        "sampling.max_tokens",
        sampling.max_tokens,
        f"prompt ({num_prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
        f"context window of {max_context_tokens} tokens; at most {room} fits",
    )


def with_eos(sampling: Sampling, eos_token_ids: Sequence[int]) -> Sampling:
    """Add the model's EOS ids to the stop ids (unless ignore_eos), so decode stops on exactly
    the tokenizer's list (generation_config.json), whatever its own config says."""
    if sampling.ignore_eos:
        return sampling
    merged = tuple(dict.fromkeys([*sampling.stop_token_ids, *eos_token_ids]))
    return replace(sampling, stop_token_ids=merged)
