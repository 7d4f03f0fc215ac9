"""The rows of one step that are near their budget: the step loop's side of budget/rows.py.

A near row is filled in the step's batch (never apart, in the slow filler: its mask is
narrowed right after the fill), each of its positions narrowed by `BudgetCloser`, and a
draft its narrowed mask excludes stops its walk there as a draft the grammar rejects does.
When a mask lost a token the grammar allowed, the row's slot says so once in the results
(NOTE_BUDGET_CLOSED beside the error code), so the engine's finish reason can.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from grammar_service.budget.rows import BudgetCloser
from step_channel import NOTE_BUDGET_CLOSED


class NearRows:
    def __init__(self, closer: BudgetCloser, masks: np.ndarray, max_positions: int):
        self.closer = closer
        self.masks = masks
        self.max_positions = max_positions
        self.rows: dict[int, tuple[int, object]] = {}  # row -> (slot, Slot)

    def __bool__(self) -> bool:
        return bool(self.rows)

    def add(self, row: int, slot: int, state, route: str) -> str:
        """Takes a near row; returns its route: the batch (a slow fill under way is waited for
        and dropped: the walk must not move a matcher being filled)."""
        if state.slow_fill is not None:
            state.slow_fill.done.wait()
            state.slow_fill = None
        self.rows[row] = (slot, state)
        return "batch"

    def narrow(self, position: int, rows: Sequence[int], drafts: dict[int, list[int]]) -> None:
        """Narrow the masks at `position` of those of `rows` that are near (their matchers stand
        there, after `drafts[row]`)."""
        for row in rows:
            near = self.rows.get(row)
            if near is not None:
                state = near[1]
                self.closer.narrow(state.budget, state.backend, state.matcher,
                                   self.masks[row * self.max_positions + position], position,
                                   drafts.get(row, ()))

    def refuses(self, walker, position: int) -> bool:
        """Whether the narrowed mask at `position` excludes the walker's draft there (which its
        matcher just accepted: it is undone)."""
        if walker.row not in self.rows:
            return False
        token = walker.drafts[position]
        word = int(self.masks[walker.row * self.max_positions + position][token >> 5])
        if (word >> (token & 31)) & 1:
            return False
        walker.matcher.rollback(1)
        return True

    def report(self, results: np.ndarray, prev_rows: list[list[int]]) -> None:
        """NOTE_BUDGET_CLOSED on the results row of each slot whose masks were narrowed and not
        reported yet (indexed by the previous step's rows; a slot not in it waits a step)."""
        pending = [(slot, state.budget) for slot, state in self.rows.values()
                   if state.budget.acted and not state.budget.reported]
        if not pending:
            return
        prev_row_of = {row[0]: r for r, row in enumerate(prev_rows)}
        for slot, budget in pending:
            r = prev_row_of.get(slot)
            if r is not None:
                results[r, 1] |= NOTE_BUDGET_CLOSED
                budget.reported = True
