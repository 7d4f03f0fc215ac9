"""How long a step that decode rows share may take (docs/serving.md, "The prefill budget").

Every decode row of a mixed step waits for the whole step: its inter-token time is the step's.
So while decode rows share a step, the step's token slots stay within what `stretch` plain
decode steps take. A mixed step of t slots costs about `fixed_s + per_token_s * t` (measured at
start, `CudaGraphRunner.measure_step_cost`); a plain decode step takes what the engine's recent
ones of as many rows took, host time included (a running mean per batch bucket: that is the
cadence a stream sees between mixed steps, and a host-bound server can afford more prefill per
step than its graphs alone suggest). A batch no plain decode step of its size has run is not
capped: every step of it is mixed, so no decode step alternates with them, and a mean of
another batch (the 1-row steps of an idle server) held the 1B shape's prefill at its floor
(H200: 320 prompt tokens a step at c=128, TTFT p50 0.48 s).
"""
from __future__ import annotations

from dataclasses import dataclass

DECODE_STEP_DECAY = 0.9     # the running mean's weight on what it held: about the last ten steps


@dataclass(frozen=True)
class MixedStepCost:
    """Measured on the device at start."""

    fixed_s: float          # a mixed step's cost at no tokens (the weight read)
    per_token_s: float      # and per token slot beyond
    decode_s: float         # a decode graph step of the largest batch

    def chunk(self, max_tokens: int, granule: int = 64) -> int:
        """The prefill whose compute costs about one decode step of the largest batch, in whole
        granules, within [granule, max_tokens]: a decode row's step beside it takes about twice
        a plain one (the budget's floor, `TokenBudget.with_decode`)."""
        return int(min(max(self.decode_s / self.per_token_s // granule * granule, granule), max_tokens))

    def tokens_within(self, seconds: float) -> int:
        """The most token slots of a mixed step that costs at most `seconds` (0 if none does)."""
        return max(int((seconds - self.fixed_s) / self.per_token_s + 1e-6), 0)  # (1e-6: float error)


def batch_bucket(num_rows: int) -> int:
    """The power of two at or above `num_rows`: decode steps of about one size share a mean."""
    return 1 << max(num_rows - 1, 0).bit_length()


class StepTime:
    """The running decode-step time per batch bucket and the step size it allows (the
    scheduler's cap)."""

    def __init__(self, cost: MixedStepCost, stretch: float) -> None:
        if stretch < 1:
            raise ValueError(f"the step stretch must be >= 1 (a mixed step takes at least a decode step), got {stretch}")
        self.cost = cost
        self.stretch = stretch
        self._decode_s: dict[int, float] = {}  # batch bucket -> running mean of its decode steps

    def observe_decode(self, seconds: float, num_rows: int) -> None:
        """A plain decode step of `num_rows` rows took `seconds` of the engine loop."""
        bucket = batch_bucket(num_rows)
        mean = self._decode_s.get(bucket)
        self._decode_s[bucket] = seconds if mean is None else \
            DECODE_STEP_DECAY * mean + (1 - DECODE_STEP_DECAY) * seconds

    def decode_s(self, num_rows: int) -> float | None:
        """The running mean of decode steps of about `num_rows` rows; None before one ran."""
        return self._decode_s.get(batch_bucket(num_rows))

    def max_step_tokens(self, num_decode_rows: int) -> int | None:
        """The most token slots of a step that `num_decode_rows` decode rows share; None (no
        cap) before a decode step of about that many rows ran."""
        decode_s = self.decode_s(num_decode_rows)
        if decode_s is None:
            return None
        return self.cost.tokens_within(self.stretch * decode_s)
