"""Per-request sampling parameters: one frozen, validated dataclass shared by every service.

The frontend builds it from a caller's request (filling every default), prefill and decode from
the SamplingParams proto; all three get the same range checks from `__post_init__`, so no value
is judged twice by two rules. Every violation is reported (not just the first), each naming its
field; the transport layer prefixes the names with `sampling.` for the gRPC BadRequest details.
Pure Python (no torch): the frontend and tokenizer processes import it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mili.engine.constraint.spec import Constraint
from mili.errors import FieldViolation, InvalidArgument

MAX_TOP_LOGPROBS = 20  # OpenAI's limit; top-n logprobs cost a [B, n] top-k per step
# Entries of logit_bias (sampling.proto): each is a scatter per row and step.
MAX_LOGIT_BIAS = 1024
# Longest prompt whose prompt logprobs may be asked for: they cost a forward over every position
# (no prefix-cache reuse) and up to ~280 bytes per prompt token in the reply, which must stay
# under gRPC's 4 MiB default receive limit of a caller's channel (8192 x 21 entries ~ 2.3 MB).
MAX_PROMPT_LOGPROBS_TOKENS = 8192
# Fields a caller may leave unset (proto3 `optional` on the wire): unset means the default below.
OPTIONAL_FIELDS = (
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
    "prompt_logprobs",
)
# Those a checkpoint's generation_config.json may give defaults for (vLLM's list, less
# max_new_tokens: the frontend's --default-max-tokens decides that); same names as HF's.
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# Temperatures below this are greedy (argmax), as in vLLM (its _SAMPLING_EPS): dividing logits
# by a smaller one overflows float32 (1e-44, a subnormal, makes every logit +-inf and the
# softmax NaN). The SamplingParams proto's `temperature` comment states it; keep them in step.
GREEDY_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A finite int or float (bools and NaN/inf rejected)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


_BIAS_RULE = "must map token ids >= 0 (each once) to biases in [-100, 100]"


def _bad_bias(bias: object) -> object | None:
    """The first entry of a logit_bias that breaks _BIAS_RULE (the whole value if it is not a
    tuple of pairs), or None."""
    if not isinstance(bias, tuple):
        return bias
    seen = set()
    for pair in bias:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            return pair
        token_id, value = pair
        if not (_is_int(token_id) and token_id >= 0 and token_id not in seen):
            return pair
        if not (_is_real(value) and -100 <= value <= 100):
            return pair
        seen.add(token_id)
    return None


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # < GREEDY_TEMPERATURE (0 too) = greedy: argmax of penalized logits
    top_p: float = 1.0  # (0, 1]; smallest set of tokens whose probability mass reaches top_p
    top_k: int = 0  # 0 = off; otherwise keep the k most likely tokens (and ties with the k-th)
    min_p: float = 0.0  # [0, 1]; drop tokens with prob < min_p * (prob of the most likely token)
    # HF semantics, on every token seen in the prompt or the output: l > 0 -> l / p, else l * p.
    repetition_penalty: float = 1.0
    # OpenAI semantics, on generated tokens only: l -= presence * (count > 0) + frequency * count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None = a fresh random seed per request
    max_tokens: int = 16
    # Generated tokens before the generation may stop: until then the sampler never draws a
    # stop id (EOS included, unless ignore_eos) and the frontend matches no stop string.
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # (token id, bias) pairs: added to the logits before every draw, as OpenAI's logit_bias;
    # bias in [-100, 100].
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None = none; 0 = chosen token only; n = chosen + top-n
    # Of the prompt's tokens (prefill computes them), as `logprobs`: None, 0 or n <= 20.
    prompt_logprobs: int | None = None
    # Stop strings, matched on the detokenized text: only the frontend sees text, so prefill
    # and decode carry none (the frontend never sends them downstream).
    stop: tuple[str, ...] = ()
    # Structured output (mili/engine/constraint/): what the whole output must match; prefill
    # and decode mask every token by it, and a finished match ends the generation (stop).
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        for name in ("stop_token_ids", "stop"):  # accept a list, store a hashable tuple
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

        errors: list[InvalidArgument] = []

        def check(is_ok: bool, field: str, reason: str) -> None:
            if not is_ok:
                errors.append(InvalidArgument(field, getattr(self, field), reason))

        # Each check tests the type first, so a wrong type never reaches a comparison.
        t, p, k, m = self.temperature, self.top_p, self.top_k, self.min_p
        check(_is_real(t) and t >= 0, "temperature", "must be a finite number >= 0")
        check(_is_real(p) and 0 < p <= 1, "top_p", "must be in (0, 1]")
        check(_is_int(k) and 0 <= k < 2**31, "top_k", "must be an integer in [0, 2^31) (0 = off)")
        check(_is_real(m) and 0 <= m <= 1, "min_p", "must be in [0, 1]")
        r = self.repetition_penalty
        check(_is_real(r) and r > 0, "repetition_penalty", "must be a finite number > 0")
        for field in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, field)
            check(_is_real(v) and -2 <= v <= 2, field, "must be in [-2, 2]")
        s = self.seed
        check(s is None or (_is_int(s) and 0 <= s < 2**64), "seed", "must be in [0, 2^64)")
        check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be >= 1")
        n = self.min_tokens
        if not (_is_int(n) and n >= 0):
            check(False, "min_tokens", "must be an integer >= 0")
        elif n:
            if _is_int(self.max_tokens) and n > self.max_tokens:
                check(False, "min_tokens", f"must be <= max_tokens ({self.max_tokens})")
            # a complete constraint ends the generation; held back, it would have nothing to draw
            check(self.constraint is None, "min_tokens", "cannot be combined with a constraint")
        check(
            isinstance(self.stop_token_ids, tuple)
            and all(_is_int(i) and i >= 0 for i in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of token ids >= 0",
        )
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool")
        bad_bias = _bad_bias(self.logit_bias)
        if bad_bias is not None:  # named alone: the whole map can be a thousand entries
            errors.append(InvalidArgument("logit_bias", bad_bias, _BIAS_RULE))
        elif len(self.logit_bias) > MAX_LOGIT_BIAS:
            num_entries = f"{len(self.logit_bias)} entries"
            reason = f"more entries than {MAX_LOGIT_BIAS}"
            errors.append(InvalidArgument("logit_bias", num_entries, reason))
        for field in ("logprobs", "prompt_logprobs"):
            n = getattr(self, field)
            check(
                n is None or (_is_int(n) and 0 <= n <= MAX_TOP_LOGPROBS),
                field,
                f"must be unset or in [0, {MAX_TOP_LOGPROBS}]",
            )
        if not (isinstance(self.stop, tuple) and all(isinstance(t, str) for t in self.stop)):
            check(False, "stop", "must be a list of strings")
        else:
            for i, text in enumerate(self.stop):
                if not text:
                    errors.append(InvalidArgument(f"stop[{i}]", text, "must not be empty"))
        c = self.constraint
        check(c is None or isinstance(c, Constraint), "constraint", "must be a Constraint")
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise InvalidArgument.many([v for e in errors for v in e.violations])

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty changes the logits (the sampler then needs the tokens so far)."""
        return (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def check_vocabulary(self, vocab_size: int) -> None:
        """InvalidArgument naming each stop_token_ids entry and logit_bias id not below the
        tokenizer's `vocab_size` (known to the services, not to these params)."""
        reason = f"outside the vocabulary (ids 0..{vocab_size - 1})"
        violations = [
            FieldViolation.of(f"stop_token_ids[{i}]", token_id, reason)
            for i, token_id in enumerate(self.stop_token_ids)
            if token_id >= vocab_size
        ]
        violations += [
            FieldViolation.of("logit_bias", token_id, reason)
            for token_id, _ in self.logit_bias
            if token_id >= vocab_size
        ]
        if violations:
            raise InvalidArgument.many(violations)

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """InvalidArgument naming `prompt_logprobs` when they were asked for a prompt longer
        than MAX_PROMPT_LOGPROBS_TOKENS (the prompt's length is known only after tokenizing)."""
        if self.prompt_logprobs is not None and num_prompt_tokens > MAX_PROMPT_LOGPROBS_TOKENS:
            raise InvalidArgument(
                "prompt_logprobs",
                self.prompt_logprobs,
                f"allowed only for prompts of at most {MAX_PROMPT_LOGPROBS_TOKENS} tokens; "
                f"this one has {num_prompt_tokens}",
            )
