"""Close on budget: a row near its max_tokens gets masks that keep a finish within it.

Each constrained row carries its request's budget (`RowBudget`): max_tokens, the tokens its
matcher advanced by, and a witness, a finish known to exist from some state (closing.py).
Per mask position, with `remaining` tokens left there (the stop token included), the
witness's length `w` and `slack` = remaining - w:
- slack >= max(WIND_DOWN, w): the grammar's mask as it is;
- MARGIN <= slack: besides the witness's next token, only tokens that open nothing new (no
  object, array, element or property: tools.py `closing`), since one such token can need more
  than the slack left to close again;
- 1 < slack < MARGIN: besides it, only content (a string's characters, a number's digits, which
  leave the way out as long as it was, give or take one token: content that splits one of the
  witness's tokens, "." of ".0", leaves its rest one token longer);
- slack <= 1, or inside a key (which only the witness's next token may choose): that token alone,
  so the document closes on time;
- a structural tag's row (tool calls) also leaves out, from slack < `open_cost` (its shortest
  output + WIND_DOWN), tokens holding the first character of a trigger or separator
  (openers.py): each opens a whole new call.
Rows far from their budget (remaining above `NEAR_FACTOR` x (w + WIND_DOWN)) cost one compare a
step. Near rows check their witness at each position: still the finish when the tokens since
followed it, or when the matcher still takes it whole from here (one more character of a
string); else the walk finds a new one. `acted` is set when a mask lost a token the grammar
allowed; the engine is told through the step's results (step_channel NOTE_BUDGET_CLOSED).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from grammar_service.backends.base import GrammarBackend, Matcher
from grammar_service.budget import json_syntax
from grammar_service.budget.closing import Closing
from grammar_service.budget.json_syntax import JsonState
from grammar_service.budget.tools import closing_tools

MARGIN = 8       # tokens of slack under which a row writes only content or the witness
WIND_DOWN = 16   # ... and under which (or under the witness's length) it opens nothing new
_KEY_MODES = frozenset({json_syntax.KEY, json_syntax.KEY_ESCAPE, json_syntax.FIRST_KEY, json_syntax.NEXT_KEY,
                        json_syntax.COLON})
NEAR_FACTOR = 2  # rows with more than this many times (witness + WIND_DOWN) left are left alone
RETRY_AFTER = 16  # tokens before a row whose walk found no finish walks again
WALK_BEYOND = 64  # a walk near the budget gives up this many tokens past it (a longer finish still steers)
ROW_WALK_SECONDS = 1.0  # ... and after this long: a bound, not a budget (a timed-out walk leaves the row unsteered)


@dataclass(slots=True)
class RowBudget:
    max_tokens: int                      # the request's max new tokens (the stop token counts)
    witness: Closing | None              # a finish from the state after `witness_at` tokens
    is_json: bool                        # the output is JSON text from its first token
    num_tokens: int = 0                  # tokens its matcher advanced by
    witness_at: int = 0
    since_witness: list[int] = field(default_factory=list)  # tokens advanced since witness_at
    tokens: list[int] = field(default_factory=list)          # all of them (JSON rows: their syntax)
    json_state: JsonState | None = field(default_factory=JsonState)
    text_len: int = 0                    # characters of the text json_state has read
    walk_after: int = 0                  # num_tokens before which no new walk is tried
    acted: bool = False                  # a mask lost a token the grammar allowed
    avoid: frozenset[str] = frozenset()  # characters that open something new beside JSON's (openers.py)
    open_cost: int = WIND_DOWN           # slack under which those are avoided: what opening one may cost
    reported: bool = False               # the engine was told

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.num_tokens

    @property
    def is_near(self) -> bool:
        w = self.witness.num_tokens if self.witness is not None else 0
        return self.remaining <= NEAR_FACTOR * (w + max(WIND_DOWN, self.open_cost))

    def count(self, tokens: Sequence[int]) -> None:
        """The matcher advanced by `tokens`."""
        self.num_tokens += len(tokens)
        self.since_witness.extend(tokens)
        if self.is_json:
            self.tokens.extend(tokens)


class BudgetCloser:
    """Narrows the masks of near rows; one per step loop (it owns the walk's buffers)."""

    def __init__(self):
        self._walks: dict[int, object] = {}  # id(backend) -> its ClosingWalk

    def narrow(self, budget: RowBudget, backend: GrammarBackend, matcher: Matcher, mask: np.ndarray,
               position: int, drafts: Sequence[int]) -> None:
        """Narrow `mask` (one int32 row, the matcher's own, at `position` after `drafts`)."""
        witness = self._witness(budget, backend, matcher, drafts)
        if witness is None:
            return
        slack = budget.remaining - position - witness.num_tokens
        winding = slack < max(WIND_DOWN, witness.num_tokens)
        avoiding = bool(budget.avoid) and slack < max(budget.open_cost, witness.num_tokens)
        if not winding and not avoiding:
            return
        state = self._json_state(budget, backend, drafts)
        tools = closing_tools(backend)
        bits = mask.view(np.uint32)
        before = bits.copy()
        first = witness.tokens[0]
        if slack <= 1 or (state is not None and state.mode in _KEY_MODES):
            bits[:] = 0  # the witness's next token: the budget's end, or a key only it may choose
        else:
            if winding:
                bits &= tools.content if slack < MARGIN else tools.closing
            if avoiding:  # a tool call's trigger or separator: a whole new call
                bits &= ~tools.holding(budget.avoid)
        bits[first >> 5] |= np.uint32(1 << (first & 31))
        if not budget.acted and not np.array_equal(bits, before):
            budget.acted = True

    def _witness(self, budget: RowBudget, backend: GrammarBackend, matcher: Matcher,
                 drafts: Sequence[int]) -> Closing | None:
        path = [*budget.since_witness, *drafts]
        known = budget.witness
        if known is not None:
            if known.tokens[:len(path)] == tuple(path) and len(path) < known.num_tokens:
                found = Closing(known.tokens[len(path):], "")
                return self._keep(budget, found) if not drafts else found
            if _takes(matcher, known.tokens):
                return self._keep(budget, known) if not drafts else known
        if budget.num_tokens < budget.walk_after:
            return None
        state = self._json_state(budget, backend, drafts)
        found = self._walk(backend).find(matcher, state, budget.remaining + WALK_BEYOND, ROW_WALK_SECONDS)
        if not drafts:
            if found is None:  # (sooner near the end)
                budget.walk_after = budget.num_tokens + max(1, min(RETRY_AFTER, budget.remaining // 8))
            budget.witness = found
            budget.witness_at, budget.since_witness = budget.num_tokens, []
        return found

    @staticmethod
    def _keep(budget: RowBudget, witness: Closing) -> Closing:
        budget.witness, budget.witness_at, budget.since_witness = witness, budget.num_tokens, []
        return witness

    def _walk(self, backend: GrammarBackend):
        walk = self._walks.get(id(backend))
        if walk is None:
            walk = self._walks[id(backend)] = closing_tools(backend).walk()
        return walk

    @staticmethod
    def _json_state(budget: RowBudget, backend: GrammarBackend, drafts: Sequence[int]) -> JsonState | None:
        """The JSON syntax after the row's tokens and `drafts` (None: not JSON text)."""
        if not budget.is_json or budget.json_state is None:
            return None
        vocab = closing_tools(backend).vocab
        text = vocab.text_of(budget.tokens)
        budget.json_state = budget.json_state.push(text[budget.text_len:])
        budget.text_len = len(text)
        if budget.json_state is None or not drafts:
            return budget.json_state
        return JsonState().push(vocab.text_of([*budget.tokens, *drafts]))


def _takes(matcher: Matcher, tokens: Sequence[int]) -> bool:
    """Whether the matcher accepts `tokens` (a whole finish) from here; it is left as it was."""
    accepted = 0
    for token in tokens:
        if not matcher.accept(token):
            break
        accepted += 1
    matcher.rollback(accepted)
    return accepted == len(tokens)
