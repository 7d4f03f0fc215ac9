"""How long a step that decode rows share may take (docs/serving.md, "The prefill budget").

Every decode row of a mixed step waits for the whole step: its inter-token time is the step's.
So while decode rows share a step, the step's token slots stay within what `stretch` plain
decode steps take. A mixed step of t slots costs about `fixed_s + per_token_s * t` (measured at
start, `CudaGraphRunner.measure_step_cost`); a plain decode step takes what the engine's recent
ones took, host time included (a running mean: that is the cadence a stream sees between
mixed steps, and a host-bound server can afford more prefill per step than its graphs alone
suggest).
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


class StepTime:
    """The running decode-step time and the step size it allows (the scheduler's cap)."""

    def __init__(self, cost: MixedStepCost, stretch: float) -> None:
        if stretch < 1:
            raise ValueError(f"the step stretch must be >= 1 (a mixed step takes at least a decode step), got {stretch}")
        self.cost = cost
        self.stretch = stretch
        self.decode_s: float | None = None   # the running mean; None before any decode step

    def observe_decode(self, seconds: float) -> None:
        """A plain decode step took `seconds` of the engine loop."""
        if self.decode_s is None:
            self.decode_s = seconds
        else:
            self.decode_s = DECODE_STEP_DECAY * self.decode_s + (1 - DECODE_STEP_DECAY) * seconds

    @property
    def max_step_tokens(self) -> int | None:
        """The most token slots of a step that decode rows share; None (no cap) before the
        first decode step."""
        if self.decode_s is None:
            return None
        return self.cost.tokens_within(self.stretch * self.decode_s)
