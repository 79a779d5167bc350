"""Per-request grammar state (torch-free: the frontend compiles constraints too).

    decode step:  mask.py fills each constrained row's allowed tokens from its matcher,
                  the sampler draws under the mask, then matcher.accept(token) per row;
                  `is_finished` ends the generation (finish reason stop)

EOS ids are allowed exactly when the grammar can end here (`can_finish`); a finished match
takes EOS and nothing else.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from mili.errors import FieldViolation, InvalidArgument, ResourceExhausted
from mili.plural import plural

if TYPE_CHECKING:
    from mili.engine.constraint.vocab import GrammarTokenizer


class ConstraintMatcher:
    """One request's position in its grammar. Not thread-safe: one step driver owns it."""

    def __init__(
        self,
        ll_matcher: Any,
        tokenizer: GrammarTokenizer,
        field_name: str = "constraint",
        lane: int = 0,
    ) -> None:
        self._m = ll_matcher  # llguidance.LLMatcher
        self.tokenizer = tokenizer
        self.field_name = field_name  # the request field it came from, for error messages
        # the compile it was copied from: the masks of one lane's matchers are computed one at
        # a time (compiler.py), so mask.py keeps each lane's rows together
        self.lane = lane
        self.num_accepted = 0

    @property
    def ll(self) -> Any:
        """The llguidance.LLMatcher (for mask.py's BatchMasker)."""
        return self._m

    def allowed(self, token_id: int) -> bool:
        """Whether `token_id` may come next (without advancing)."""
        if not 0 <= token_id < self.tokenizer.num_tokens or self._m.is_error():
            return False
        if self._m.is_stopped():  # a finished match takes EOS (llguidance refuses it here)
            return token_id in self.tokenizer.eos_token_ids
        return int(self._m.validate_tokens([token_id])) == 1

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token. False (and the matcher in its error state) when the
        grammar forbids it, which a masked sample never is."""
        if not self.allowed(token_id):
            return False
        if self._m.is_stopped():
            return True  # EOS after a finished match: nothing left to advance
        ok = bool(self._m.consume_token(token_id))
        self.num_accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts, a retried step)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        if not self._m.rollback(num_tokens):
            raise RuntimeError(f"rollback failed: {self._m.get_error()}")
        self.num_accepted -= num_tokens

    @property
    def can_finish(self) -> bool:
        """The output so far is a complete match: EOS is allowed now."""
        return bool(self._m.is_accepting())

    @property
    def is_finished(self) -> bool:
        """Nothing more may follow (the match is complete and cannot extend, or EOS was
        accepted): the generation stops here with finish reason `stop`."""
        return bool(self._m.is_stopped()) and not self._m.is_error()

    @property
    def error(self) -> str:
        """Why the matcher is in its error state ('' when it is not)."""
        return str(self._m.get_error())

    def spelled_alternative(self) -> int | None:
        """Where the text the grammar forces next spells a special token (a regex "<think>",
        a property named "<tool_call>"), llguidance offers that token but its matcher refuses
        it (a special token is no text to the grammar): the forced text's first token spelled
        in plain pieces, when the matcher takes it (mask.py offers it instead)."""
        forced = bytes(self._m.compute_ff_bytes()).decode(errors="ignore")
        spelled = self.tokenizer.ll.greedy_tokenize(forced)[:1]
        return spelled[0] if spelled and self.allowed(spelled[0]) else None

    def dead_end(self) -> InvalidArgument | None:
        """InvalidArgument naming the field when no token can continue the match here (the
        mask, mended, would be empty), else None. llguidance offers only special tokens its
        matcher refuses: a grammar that names an end-of-sequence token (`<|im_end|>`,
        `<[151645]>`) asks for one the model writes by itself wherever the grammar can end,
        and that no grammar can match. Costs a mask; for refusals and the start state."""
        if self._m.is_error() or self._m.is_stopped():
            return None
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), np.uint8), bitorder="little")
        offered = np.flatnonzero(bits[: self.tokenizer.vocab_rows]).tolist()
        specials = set(self.tokenizer.special_ids)
        if any(t not in specials or self.allowed(t) for t in offered):
            return self._endless()
        if self.spelled_alternative() is not None:
            return None
        names = ", ".join(self.tokenizer.decode([t]) or f"<[{t}]>" for t in offered)
        why = f"no token can continue it {self._where}"
        if set(offered) & set(self.tokenizer.eos_token_ids):
            why += (
                f": it asks for {names}, an end-of-sequence token, which the model writes by "
                "itself wherever the grammar can end (a grammar cannot match one: leave it out)"
            )
        return InvalidArgument.many([FieldViolation(self.field_name, why)])

    @property
    def _where(self) -> str:
        """Where the match stands, for messages: "at its start", "after 3 tokens"."""
        if not self.num_accepted:
            return "at its start"
        return f"after {plural(self.num_accepted, 'token')}"

    def _endless(self) -> InvalidArgument | None:
        """InvalidArgument when the text the grammar forces from here never ends (`start: "a"
        start`: it matches no finite string). The mask shows nothing wrong; llguidance runs out
        of parser items only when a token is taken and it follows the forced text, which a
        copy tries here, so the frontend's compile refuses what prefill's first token would."""
        forced = self._m.compute_ff_tokens()
        if not forced:
            return None
        probe = self._m.deep_copy()
        if probe.consume_token(forced[0]) or _FORCED_TEXT_LIMIT not in str(probe.get_error()):
            return None
        return self._never_ends()

    def _never_ends(self) -> InvalidArgument:
        why = (
            f"the text it forces {self._where} never ends, as far as the grammar engine follows "
            "it: it matches no finite string (a rule that always calls itself again, as in "
            '`start: "a" start`)'
        )
        return InvalidArgument.many([FieldViolation(self.field_name, why)])

    def refusal(self, token_id: int, where: str) -> Exception:
        """What to fail the request with when `accept(token_id)` refused a token the mask
        allowed, at `where` ("first token", "output position 5"): a grammar whose forced text
        never ends from here, or at a dead end (its mask was empty, so the draw was garbage),
        is INVALID_ARGUMENT naming the field; the grammar engine out of one of its other limits
        (a constraint that compiled but is too complex further in) RESOURCE_EXHAUSTED naming
        it; anything else a ConstraintError (a bug)."""
        why = self.error or "not among the tokens it allows next"
        if _FORCED_TEXT_LIMIT in why:
            # a grammar endless only past a choice (`start: "b" | "c" x`, `x: "a" x`): compile
            # saw the start's forced text end, the token into the endless branch hit the limit
            return self._never_ends()
        limit_hit = too_complex(self.field_name, why)
        if limit_hit is not None:
            return limit_hit
        dead_end = self.dead_end()
        if dead_end is not None:
            return dead_end
        return ConstraintError(
            f"token {token_id} ({where}) breaks the constraint {self.field_name}: "
            f"{' '.join(why.split())[:300]}"
        )


# llguidance's words when following the text a grammar forces ran out of parser items
_FORCED_TEXT_LIMIT = "ff_tokens"
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_NON_VERBOSE = "<non-verbose/>"


def too_complex(field_name: str, error: str) -> ResourceExhausted | None:
    """The error for llguidance's `error` when it is one of the library's limits hit (lexer
    fuel, too many states or expressions): RESOURCE_EXHAUSTED naming the field, the same at
    compile and at any later token. Its own words count, not what it quotes of the schema (a
    property named "limit" is not a limit hit)."""
    unquoted = _QUOTED.sub("", error).lower()
    if any(word in unquoted for word in ("fuel", "too complex", "too many", "limit")):
        # without the markup its non-verbose errors end with, on one line
        words = " ".join(error.replace(_NON_VERBOSE, "").split())
        return ResourceExhausted(f"{field_name}: the constraint is too complex ({words})")
    return None


class ConstraintError(RuntimeError):
    """A constrained generation cannot go on: the sampled token is not allowed, or the grammar
    engine hit an error (its message says which constraint and why)."""
