"""Per-slot matcher state of one step channel (slot = the engine's request pool index)."""
from __future__ import annotations

from dataclasses import dataclass

from grammar_service.backends.base import GrammarBackend, Matcher
from grammar_service.budget.rows import RowBudget
from grammar_service.slow_filler import SlowFill
from step_channel import ERR_NONE


@dataclass
class Slot:
    matcher: Matcher | None = None
    backend: GrammarBackend | None = None  # the backend that made the matcher (batch calls group by it)
    grammar_id: int = 0
    is_terminated: bool = False  # accepted a stop token; later tokens of the slot are ignored
    pending_error: int = ERR_NONE  # reported with the slot's next results row, then cleared
    # Slow-row isolation (slow_rows.py): a fill timed alone on the step's path decides whether
    # the row is slow; a slow row's masks are filled in the slow filler (slow_filler.py), off that path.
    fill_delay_s: float = 0.0      # GrammarServiceConfig.slow_fill_ms for this slot's grammar
    num_fills_since_timed: int = -1  # -1: never timed (its next fill is); slow_rows.RETIME_EVERY
    is_slow: bool = False
    was_late: bool = False             # a step got VALID_LATE for it: the engine sits it out (prefetch)
    slow_fill: SlowFill | None = None  # a slow fill of the current state, not yet used
    budget: RowBudget | None = None    # the request's max_tokens (budget/rows.py: close on budget)

    @property
    def can_fill(self) -> bool:
        return self.matcher is not None and not self.is_terminated


class SlotTable:
    """Slots [0, max_slots); only the channel's loop thread touches them."""

    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.states = [Slot() for _ in range(max_slots)]  # indexed by slot; the loop reads it directly

    def __getitem__(self, slot: int) -> Slot:
        return self.states[slot]

    def is_valid(self, slot: int) -> bool:
        return 0 <= slot < self.max_slots

    def bind(self, slot: int, backend: GrammarBackend, matcher: Matcher, grammar_id: int,
             fill_delay_s: float = 0.0, budget: RowBudget | None = None) -> None:
        """FRESH: a new request's matcher replaces whatever the slot held (a slow fill of the
        old one finishes unread)."""
        self.states[slot] = Slot(matcher=matcher, backend=backend, grammar_id=grammar_id,
                                 fill_delay_s=fill_delay_s, budget=budget)

    def fail(self, slot: int, error: int) -> None:
        """Drop the matcher (never left desynchronised) and report `error` on the next results."""
        self.states[slot] = Slot(pending_error=error)

    def release(self, slot: int) -> None:
        self.states[slot] = Slot()

    @property
    def num_bound(self) -> int:
        return sum(1 for s in self.states if s.matcher is not None)
