"""LateMask: when a slow grammar's next mask is likely ready (issue 19 point 6).

A row whose mask was late once (VALID_LATE: its grammar fills masks slower than the engine's
forward) would keep every step of its batch on the host path, which lets one row be late but
costs the decode graphs' speed to every other row. Instead it sits out of steps while its next
mask is likely still being filled: grammar_service starts that fill as soon as the row's matcher
advances (loop.py), and the engine schedules the row again once about the fill's time has passed
since its last token. The other rows run as decode graphs meanwhile; the late row joins a host
step when due, and if its mask is still not ready then, tries again a fraction of that time
later. The fill time is learnt from the row itself: the time from one of its tokens to the next.
"""
from __future__ import annotations

from dataclasses import dataclass

DUE_FRACTION = 0.9     # back in steps after this share of the learnt fill time since its last token
RETRY_FRACTION = 0.25  # late again: back after this share of it
DECAY = 0.5            # the running estimate's weight on its past (a few tokens follow a change)


@dataclass
class LateMask:
    """A late row's fill-time estimate and when it is next scheduled (times: time.monotonic)."""

    fill_s: float | None = None       # running estimate: one of its tokens to the next; None: unknown yet
    last_token_s: float | None = None
    due_s: float = 0.0                # it sits out of steps until then

    def is_due(self, now: float) -> bool:
        return now >= self.due_s

    def late(self, now: float) -> None:
        """Its mask was late again in a step."""
        self.due_s = now + RETRY_FRACTION * (self.fill_s or 0.0)

    def sampled(self, now: float) -> None:
        """A token of it was sampled (its mask was ready): its next mask fills from now."""
        if self.last_token_s is not None:
            seen = now - self.last_token_s
            self.fill_s = seen if self.fill_s is None else DECAY * self.fill_s + (1 - DECAY) * seen
        self.last_token_s = now
        self.due_s = now + DUE_FRACTION * (self.fill_s or 0.0)
