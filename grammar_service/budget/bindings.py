"""Binding ids: a compiled grammar with a request's token budget, what a FRESH row names.

A Compile call that carries `max_tokens` is answered with a binding id rather than the
grammar's own: the grammar stays cached by content, and the step loop learns the budget
when it binds the row, so the step channel carries nothing more. Each grammar's shortest
document (a closing walk from its start state) is found once; a budget below it is refused
(`BudgetTooSmall`, INVALID_ARGUMENT naming the minimum). Ids live in [2**30, 2**31), apart
from the compiler's grammar ids, and start at a random point (a restarted service names
nothing an old id named).
"""
from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass

from grammar_service.backends.base import GrammarBackend
from grammar_service.budget.closing import Closing
from grammar_service.budget.json_syntax import JsonState
from grammar_service.budget.rows import WIND_DOWN, RowBudget
from grammar_service.budget.tools import closing_tools

_FIRST_ID = 1 << 30
_ID_SPAN = 1 << 29  # a random start in [2**30, 2**30 + 2**29): 2**29 ids before the int32 limit
_SHOWN_CHARS = 120  # of the shortest document, in the refusal's message


class BudgetTooSmall(ValueError):
    """max_tokens below the grammar's shortest document."""


@dataclass(frozen=True)
class Binding:
    grammar_id: int
    max_tokens: int
    shortest: Closing | None  # None: the walk found no finish (no check, no closing)
    is_json: bool
    avoid: frozenset[str] = frozenset()  # characters that open something new beside JSON's (openers.py)

    def row_budget(self) -> RowBudget | None:
        """None where the walk found no finish from the start: no closing for this grammar (its
        walks near the budget would fail alike, at the step's cost)."""
        if self.shortest is None:
            return None
        # opening a new call may cost about a whole shortest output (each has at least one call)
        return RowBudget(self.max_tokens, self.shortest, self.is_json, avoid=self.avoid,
                         open_cost=self.shortest.num_tokens + WIND_DOWN if self.avoid else WIND_DOWN)


class BudgetBindings:
    def __init__(self, max_bindings: int):
        self._max_bindings = max_bindings
        self._lock = threading.Lock()
        self._next_id = _FIRST_ID + secrets.randbelow(_ID_SPAN)
        self._by_id: OrderedDict[int, Binding] = OrderedDict()
        self._ids: dict[tuple[int, int], int] = {}      # (grammar id, max_tokens) -> binding id
        self._shortest: dict[int, Closing | None] = {}  # grammar id -> its shortest document

    def bind(self, grammar_id: int, backend: GrammarBackend, compiled, max_tokens: int, is_json: bool,
             avoid: frozenset[str] = frozenset()) -> int:
        """The binding id of (grammar, max_tokens); raises BudgetTooSmall. `avoid`: characters
        whose tokens a row near its budget leaves out (openers.py)."""
        shortest = self.shortest(grammar_id, backend, compiled, is_json)
        if avoid:
            closing_tools(backend).holding(avoid)  # built here, not in a step
        if shortest is not None and max_tokens < shortest.num_tokens:
            text = shortest.text if len(shortest.text) <= _SHOWN_CHARS else shortest.text[:_SHOWN_CHARS] + "..."
            raise BudgetTooSmall(
                f"max_tokens {max_tokens} is below the shortest output this grammar allows, "
                f"{shortest.num_tokens} tokens with the stop token ({text!r}); set max_tokens to at "
                f"least {shortest.num_tokens}")
        with self._lock:
            key = (grammar_id, max_tokens)
            binding_id = self._ids.get(key)
            if binding_id is None:
                binding_id = self._ids[key] = self._next_id
                self._next_id += 1
                self._by_id[binding_id] = Binding(grammar_id, max_tokens, shortest, is_json, avoid)
                while len(self._by_id) > self._max_bindings:
                    _, old = self._by_id.popitem(last=False)
                    del self._ids[(old.grammar_id, old.max_tokens)]
            self._by_id.move_to_end(binding_id)
            return binding_id

    def get(self, binding_id: int) -> Binding | None:
        with self._lock:
            return self._by_id.get(binding_id)

    def shortest(self, grammar_id: int, backend: GrammarBackend, compiled, is_json: bool) -> Closing | None:
        """The grammar's shortest document found by a closing walk (once per grammar)."""
        with self._lock:
            if grammar_id in self._shortest:
                return self._shortest[grammar_id]
        found = closing_tools(backend).walk().find(backend.new_matcher(compiled), JsonState() if is_json else None)
        with self._lock:
            self._shortest[grammar_id] = found
            while len(self._shortest) > self._max_bindings:
                self._shortest.pop(next(iter(self._shortest)))
        return found

    @staticmethod
    def is_binding_id(some_id: int) -> bool:
        return some_id >= _FIRST_ID
