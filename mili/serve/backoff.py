"""How long `mili serve` waits before restarting a child that died: pure bookkeeping, no clock.

    failures in a row   0     1     2     3     4     5     6    ...
    delay (defaults)    0.5   1     2     4     8     16    30   30 ... (capped at max_delay_s)

A child that stayed up `reset_after_s` before dying starts over at `initial_delay_s`: one crash
a day costs half a second, a crash loop settles at one attempt every `max_delay_s` and never
spins hot.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    factor: float = 2.0
    # Up this long (since it answered SERVING) and its next death counts as a first failure.
    reset_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_delay_s <= self.max_delay_s:
            raise ValueError(
                f"need 0 < initial_delay_s <= max_delay_s, got {self.initial_delay_s} and "
                f"{self.max_delay_s}"
            )
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, got {self.factor}")
        if self.reset_after_s <= 0:
            raise ValueError(f"reset_after_s must be > 0, got {self.reset_after_s}")


class Backoff:
    """The restart delays of one child."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.num_failures = 0  # deaths in a row, each within reset_after_s of the last start

    def next_delay(self, up_s: float) -> float:
        """The child died after `up_s` seconds up (0 if it never got ready): wait this long."""
        if up_s >= self.policy.reset_after_s:
            self.num_failures = 0
        policy = self.policy
        # min() before the power would overflow: stop growing once past the cap.
        delay = policy.initial_delay_s
        for _ in range(self.num_failures):
            delay = min(delay * policy.factor, policy.max_delay_s)
            if delay == policy.max_delay_s:
                break
        self.num_failures += 1
        return delay
