"""How long `mili serve` waits before restarting a child that died: pure bookkeeping, no clock.

    failures in a row   0     1     2     3     4     5     6    ...
    delay               0.5   1     2     4     8     16    30   30 ... (capped at MAX_DELAY_S)

A child that stayed up `RESET_AFTER_S` before dying starts over at `INITIAL_DELAY_S`: one crash
a day costs half a second, a crash loop settles at one attempt every `MAX_DELAY_S` and never
spins hot.
"""

from __future__ import annotations

INITIAL_DELAY_S = 0.5
MAX_DELAY_S = 30.0
FACTOR = 2.0
# Up this long (since it answered SERVING) and its next death counts as a first failure.
RESET_AFTER_S = 60.0


class Backoff:
    """The restart delays of one child."""

    def __init__(self) -> None:
        self.num_failures = 0  # deaths in a row, each within RESET_AFTER_S of the last start

    def next_delay(self, up_s: float) -> float:
        """The child died after `up_s` seconds up (0 if it never got ready): wait this long."""
        if up_s >= RESET_AFTER_S:
            self.num_failures = 0
        # min() before the power would overflow: stop growing once past the cap.
        delay = INITIAL_DELAY_S
        for _ in range(self.num_failures):
            delay = min(delay * FACTOR, MAX_DELAY_S)
            if delay == MAX_DELAY_S:
                break
        self.num_failures += 1
        return delay
