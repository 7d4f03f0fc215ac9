"""The step loop of one open channel: docs/step_channel.md §"Entry N", step 3, as code.

    wait inputs_seq >= N
    a. advance the matchers of step N-1's rows by the tokens it accepted -> results (entry N);
       the next fill of a slow row that was late once starts in the slow filler at once
    b. release-only rows, then FRESH binds
    c. fill step N's mask rows, walking drafts with accept + rollback -> valid_positions;
       a slow row's mask comes from the slow filler, or the row is late (VALID_LATE);
       FLAG_FORCED_DRAFTS rows: the run the grammar forces at the walk's end -> forced_*
    d. mask_status = MASK_OK, mask_seq = N

Every backend call covers all rows of a step at one position (batch_accept / batch_fill /
batch_rollback), one call per backend present in the step (usually one); Python touches
rows only for bookkeeping. Masks are written in place in
the shared region; rows that are not filled with a grammar mask are all ones, and only rows
that were written with a grammar mask on the entry's previous use are reset.

Slow rows (slow_rows.py; docs/step_channel.md, "Late rows"): on steps whose descriptor gives
`forward_us`, a row whose fill alone is slow has its masks filled apart, beside the batch fill,
and is late (VALID_LATE) when that fill is not done by the end of the engine's forward.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np

from grammar_service import metrics
from grammar_service.backends.base import GrammarBackend, Matcher
from grammar_service.budget.near import NearRows
from grammar_service.budget.rows import BudgetCloser, RowBudget
from grammar_service.slots import Slot, SlotTable
from grammar_service.slow_rows import SlowRows
from step_channel import (
    ERR_INTERNAL, ERR_NO_MATCHER, ERR_NONE, ERR_TOKEN_REJECTED, ERR_UNKNOWN_GRAMMAR,
    FLAG_CONSTRAINED, FLAG_FORCED_DRAFTS, FLAG_FRESH, FLAG_RELEASE, MASK_OK, StepChannel,
)

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05     # wake up this often without inputs: heartbeat, stop flag
WAIT_SPIN_S = 100e-6   # default: spin this long on inputs_seq, then sleep in steps of at most...
WAIT_SLEEP_S = 100e-6  # ...this (the fill overlaps the forward; wake-up latency adds to it)


T = TypeVar("T")


def by_backend(items: Sequence[T], backend_of: Callable[[T], GrammarBackend],
               single: GrammarBackend | None = None) -> Iterator[tuple[GrammarBackend, list[T]]]:
    """Split `items` by backend, keeping order within each group. `single`: the caller
    knows every item has this backend (the usual case; no per-item look)."""
    if single is not None:
        yield single, list(items)
        return
    groups: dict[int, tuple[GrammarBackend, list[T]]] = {}
    for item in items:
        backend = backend_of(item)
        groups.setdefault(id(backend), (backend, []))[1].append(item)
    yield from groups.values()


def the_only_backend(backends: Iterator[GrammarBackend]) -> GrammarBackend | None:
    """The backend if all are the same one, else None (also for none)."""
    only = None
    for backend in backends:
        if only is None:
            only = backend
        elif backend is not only:
            return None
    return only


@dataclass(slots=True)
class _Walker:
    """A constrained row being filled: its matcher walks the row's drafts."""
    row: int
    matcher: Matcher
    backend: GrammarBackend
    num_positions: int
    drafts: list[int]
    num_accepted: int = 0


@dataclass(slots=True)
class StepPhases:
    """Nanoseconds by phase, summed over steps; advance + fill + bookkeeping = step time.

    advance: a. fill: c. bookkeeping: everything else (descriptor, b, releases, stale rows,
    publishing)."""
    advance_ns: int = 0
    fill_ns: int = 0
    bookkeeping_ns: int = 0

    def add(self, advance_ns: int, fill_ns: int, step_ns: int) -> None:
        bookkeeping_ns = step_ns - advance_ns - fill_ns
        self.advance_ns += advance_ns
        self.fill_ns += fill_ns
        self.bookkeeping_ns += bookkeeping_ns
        metrics.STEP_PHASE_SECONDS.labels("advance").inc(advance_ns / 1e9)
        metrics.STEP_PHASE_SECONDS.labels("fill").inc(fill_ns / 1e9)
        metrics.STEP_PHASE_SECONDS.labels("bookkeeping").inc(bookkeeping_ns / 1e9)


class StepLoop:
    """Owns a channel's slots and its loop thread; `start`, then `stop` from another thread."""

    def __init__(self, channel: StepChannel, max_slots: int, first_step: int,
                 lookup_grammar: Callable[[int], tuple[GrammarBackend, Any] | None],
                 wait_spin_s: float = WAIT_SPIN_S, isolate_slow_rows: bool = True,
                 fill_delay_of: Callable[[int], float] = lambda grammar_id: 0.0,
                 budget_of: Callable[[int], RowBudget | None] = lambda grammar_id: None):
        self.channel = channel
        self.wait_spin_s = wait_spin_s  # GrammarServiceConfig.step_wait_spin_us
        self._fill_delay_of = fill_delay_of  # grammar id -> seconds (GrammarServiceConfig.slow_fill_ms)
        self.slots = SlotTable(max_slots)
        self.slow_rows = SlowRows(channel, self.slots, enabled=isolate_slow_rows)  # GrammarServiceConfig
        self.phases = StepPhases()
        self.next_step = first_step
        self._first_step = first_step
        self._lookup_grammar = lookup_grammar  # grammar id -> (backend, compiled grammar) or None
        self._budget_of = budget_of            # grammar id -> a new row's budget (budget/rows.py)
        self.closer = BudgetCloser()
        g = channel.geometry
        self._dirty: list[set[int]] = [set() for _ in range(g.depth)]  # per entry: rows not all ones
        self._prev_rows: list[list[int]] = []  # descriptor rows of the previous step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        self.total_step_ns = 0
        self._step_ns: deque[int] = deque(maxlen=1024)
        for k in range(g.depth):  # the region starts zeroed; unconstrained rows are all ones
            channel.entry(k).masks[:] = -1
        self._stop_only_rows: dict[int, np.ndarray] = {}  # backend id -> stop-tokens-only mask row

    # ---- thread --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"step-loop-{self.channel.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.slow_rows.close(timeout_s)

    def _run(self) -> None:
        chan = self.channel
        while not self._stop.is_set():
            chan.beat()
            if chan.wait_seq("inputs_seq", self.next_step, timeout_s=IDLE_WAIT_S,
                             spin_s=self.wait_spin_s, max_sleep_s=WAIT_SLEEP_S):
                self.run_step(self.next_step)
                self.next_step += 1

    @property
    def mean_step_us(self) -> float:
        return sum(self._step_ns) / len(self._step_ns) / 1e3 if self._step_ns else 0.0

    def recent_step_us(self) -> dict[str, float]:
        """Percentiles (p50, p90, p99, max) of the last 1024 steps' times in us; {} before any."""
        times = sorted(self._step_ns)
        if not times:
            return {}
        at = {"p50": 0.50, "p90": 0.90, "p99": 0.99}
        out = {name: times[min(len(times) - 1, int(q * len(times)))] / 1e3 for name, q in at.items()}
        out["max"] = times[-1] / 1e3
        return out

    # ---- one step ------------------------------------------------------------------------
    def run_step(self, step: int) -> None:
        """Process step `step` (its inputs are published) and publish its masks."""
        started = time.perf_counter_ns()
        entry = self.channel.entry(step)
        g = self.channel.geometry
        # (slot, num_positions, flags, grammar_id) per row; a copy, read once
        rows = entry.desc_rows[:min(entry.batch_size, g.max_batch)].tolist()
        advance_ns = fill_ns = 0
        try:
            advance_started = time.perf_counter_ns()
            if step != self._first_step:
                self._advance(self._prev_rows, self.channel.entry(step - 1), entry.results)
            advance_ns = time.perf_counter_ns() - advance_started
            self._bind_and_release(rows)
            fill_started = time.perf_counter_ns()
            self._fill(step, rows)
            fill_ns = time.perf_counter_ns() - fill_started
            for slot, num_positions, flags, _ in rows:
                if flags & FLAG_RELEASE and num_positions > 0 and self.slots.is_valid(slot):
                    self.slots.release(slot)  # dropped after this step's fill
        except Exception:  # never leave the GPU waiting on a bug
            log.exception("step %d of channel %s failed", step, self.channel.name)
            self._fail_step(step, rows)
        self._prev_rows = rows
        entry.mask_status[0] = MASK_OK
        self.channel.publish_seq("mask_seq", step)
        elapsed_ns = time.perf_counter_ns() - started
        self.num_steps += 1
        self.total_step_ns += elapsed_ns
        self._step_ns.append(elapsed_ns)
        self.phases.add(advance_ns, fill_ns, elapsed_ns)
        metrics.STEP_SECONDS.observe(elapsed_ns / 1e9)

    def _fail_step(self, step: int, rows: list[list[int]]) -> None:
        """Fail this step's constrained rows (ERR_INTERNAL, valid 0, matcher dropped); free rows go on."""
        g, entry = self.channel.geometry, self.channel.entry(step)
        entry.masks[:len(rows) * g.max_positions] = -1  # no half-filled rows left behind
        entry.forced_counts[:len(rows)] = 0
        self._dirty[step % g.depth] = set()
        entry.results[:len(self._prev_rows), 1] = ERR_INTERNAL
        for r, (slot, num_positions, flags, _) in enumerate(rows):
            is_constrained = bool(flags & FLAG_CONSTRAINED)
            entry.valid_positions[r] = 0 if is_constrained else min(max(num_positions, 0), g.max_positions)
            if is_constrained and self.slots.is_valid(slot):
                self.slots.release(slot)

    def _advance(self, prev_rows: list[list[int]], prev_entry, results: np.ndarray) -> None:
        """a. Deferred advance by step N-1's accepted tokens; results indexed by N-1's rows."""
        n = len(prev_rows)
        results[:n] = (-1, ERR_NONE)
        counts, out_tokens = prev_entry.out_counts[:n].tolist(), prev_entry.out_tokens[:n].tolist()
        states, max_slots = self.slots.states, self.slots.max_slots
        active = []  # (row, slot, its state, tokens)
        for r, (slot, _, flags, _) in enumerate(prev_rows):
            if not flags & FLAG_CONSTRAINED or flags & FLAG_RELEASE or not 0 <= slot < max_slots:
                continue
            state = states[slot]
            if state.pending_error != ERR_NONE:
                results[r, 1] = state.pending_error
                state.pending_error = ERR_NONE
            elif state.matcher is None:
                results[r, 1] = ERR_NO_MATCHER
            elif not state.is_terminated and counts[r] > 0:
                active.append((r, slot, state, out_tokens[r][:counts[r]]))
                if state.budget is not None:
                    state.budget.count(active[-1][3])
        single = the_only_backend(a[2].backend for a in active)
        moved = [(slot, state) for _, slot, state, _ in active]
        j = 0
        while active:  # one batched accept per token index j
            still = []
            for item, ok in self._batch_accept(active, lambda a: a[2].matcher, lambda a: a[2].backend,
                                               lambda a: a[3][j], single, advance=True):
                r, slot, state, tokens = item
                if not ok:
                    log.info("slot %d: token %d (index %d) rejected by its grammar", slot, tokens[j], j)
                    results[r, 1] = ERR_TOKEN_REJECTED
                    metrics.ROWS_REJECTED.inc()
                    self.slots.release(slot)
                elif tokens[j] in state.backend.stop_token_ids and state.matcher.is_terminated():
                    results[r, 0] = j  # later tokens of the row are past the end: ignored
                    state.is_terminated = True
                elif j + 1 < len(tokens):
                    still.append(item)
            active, j = still, j + 1
        self.slow_rows.prefetch([state for slot, state in moved if states[slot] is state])

    def _bind_and_release(self, rows: list[list[int]]) -> None:
        """b. Release-only rows first (a slot may be reused in the same step), then FRESH."""
        for slot, num_positions, flags, _ in rows:
            if flags & FLAG_RELEASE and num_positions == 0 and self.slots.is_valid(slot):
                self.slots.release(slot)
        for slot, _, flags, grammar_id in rows:
            if not flags & FLAG_FRESH or not self.slots.is_valid(slot):
                continue
            found = self._lookup_grammar(grammar_id)
            if found is None:
                self.slots.fail(slot, ERR_UNKNOWN_GRAMMAR)
            else:
                backend, compiled = found
                self.slots.bind(slot, backend, backend.new_matcher(compiled), grammar_id,
                                self._fill_delay_of(grammar_id), self._budget_of(grammar_id))

    def _fill(self, step: int, rows: list[list[int]]) -> None:
        """c. One mask row per position; drafts walked with accept, undone with rollback; slow
        rows from the filler if done by the end of the engine's forward, else late."""
        g = self.channel.geometry
        entry = self.channel.entry(step)
        slow_rows = self.slow_rows
        slow_ns = slow_rows.threshold_ns(int(entry.forward_us[0]))
        apart: list[tuple[int, int, Slot]] = []  # (row, slot, state): masks from the slow filler
        timed: list[tuple[int, int, Slot]] = []  # (row, slot, state): filled alone here, timed
        delay_s = 0.0                            # the batch rows' slow_fill_ms (tests)
        max_pos, masks = g.max_positions, entry.masks
        states, max_slots = self.slots.states, self.slots.max_slots
        drafts = entry.drafts[:len(rows)].tolist() if max_pos > 1 else None
        valid = [0] * len(rows)
        first: list[tuple[int, Matcher, GrammarBackend]] = []  # (row, matcher, backend) filled at position 0
        walkers: list[_Walker] = []  # rows with drafts: their matchers walk on past position 0
        forcing: list[tuple[int, Matcher]] = []  # FLAG_FORCED_DRAFTS rows filled here
        entry.forced_counts[:len(rows)] = 0
        filled: list[int] = []
        near = NearRows(self.closer, masks, max_pos)  # rows near their budget: narrowed masks
        for r, (slot, num_positions, flags, _) in enumerate(rows):
            if not 0 <= num_positions <= max_pos:
                num_positions = min(max(num_positions, 0), max_pos)
            if not flags & FLAG_CONSTRAINED:
                valid[r] = num_positions
                continue
            state = states[slot] if 0 <= slot < max_slots else None
            if state is None or num_positions == 0:
                continue  # valid 0: no slot (a bug of the caller) or nothing to fill
            if state.can_fill:
                valid[r] = 1
                # (GPU steps: no slow row, no call per row; a row near its budget is narrowed here)
                route = slow_rows.route(state, num_positions, slow_ns) if slow_ns or state.slow_fill else "batch"
                if state.budget is not None and state.budget.is_near:
                    route = near.add(r, slot, state, route)
                if route == "apart":
                    apart.append((r, slot, state))
                    continue
                if route == "timed":  # filled alone, but here on the step's path: its run too
                    timed.append((r, slot, state))
                    if flags & FLAG_FORCED_DRAFTS and max_pos > 1:
                        forcing.append((r, state.matcher))
                    continue
                delay_s = max(delay_s, state.fill_delay_s)
                first.append((r, state.matcher, state.backend))
                if flags & FLAG_FORCED_DRAFTS and max_pos > 1:
                    forcing.append((r, state.matcher))
                if num_positions > 1:
                    walkers.append(_Walker(r, state.matcher, state.backend, num_positions,
                                           drafts[r][:num_positions - 1]))
            elif state.is_terminated:
                masks[r * max_pos] = self._stop_only(state.backend)
                filled.append(r * max_pos)
                valid[r] = 1
            # else valid 0: no matcher; its error is in the results
        slow_rows.start(apart)  # first: they fill beside everything below
        filled.extend(slow_rows.fill_timed(timed, masks, max_pos, slow_ns))
        if delay_s:
            time.sleep(delay_s)
        single = the_only_backend(backend for _, _, backend in first)
        filled.extend(self._batch_fill(first, itemgetter(0), itemgetter(1), itemgetter(2), single,
                                       masks, max_pos, 0))
        if near:
            near.narrow(0, [r for r, _, _ in first], {})
        level = walkers
        for p in range(max_pos - 1):  # accept draft p, then fill position p + 1 behind it
            if not level:
                break
            next_level = []
            for w, ok in self._batch_accept(level, lambda w: w.matcher, lambda w: w.backend,
                                            lambda w: w.drafts[p], single):
                if not ok or (near and near.refuses(w, p)):
                    continue  # the mask at p excludes this draft: the verifier stops there
                w.num_accepted += 1
                if w.drafts[p] in w.backend.stop_token_ids and w.matcher.is_terminated():
                    continue  # a stop draft ended the grammar: no position after it
                valid[w.row] = p + 2
                next_level.append(w)
            filled.extend(self._batch_fill(next_level, attrgetter("row"), attrgetter("matcher"),
                                           attrgetter("backend"), single, masks, max_pos, p + 1))
            if near:
                near.narrow(p + 1, [w.row for w in next_level], {w.row: w.drafts[:p + 1] for w in next_level})
            level = [w for w in next_level if w.num_positions > p + 2]
        if forcing:  # each matcher stands at its row's last exact position, valid - 1
            self._write_forced(entry, forcing, max_pos)
        undo = [w for w in walkers if w.num_accepted]
        if undo:
            for backend, group in by_backend(undo, lambda w: w.backend, single):
                backend.batch_rollback([w.matcher for w in group], [w.num_accepted for w in group])
        filled.extend(slow_rows.collect(step, apart, masks, max_pos, valid, slow_ns))
        entry.valid_positions[:len(rows)] = valid
        if near:
            near.report(entry.results, self._prev_rows)
        self._reset_stale(step, set(filled))

    @staticmethod
    def _write_forced(entry, forcing: list[tuple[int, Matcher]], max_pos: int) -> None:
        """The run each row's grammar forces from where its walk stopped (at most max_pos
        tokens: the token sampled there and the next step's drafts). A call per row, only for
        the rows that asked (the grammar proposer's)."""
        for r, matcher in forcing:
            if matcher.is_terminated():  # a stop draft ended the grammar: nothing follows
                continue
            run = matcher.jump_forward_tokens()[:max_pos]
            if run:
                entry.forced_tokens[r, :len(run)] = run
                entry.forced_counts[r] = len(run)

    def _stop_only(self, backend: GrammarBackend) -> np.ndarray:
        """The mask row of a terminated matcher: only stop tokens stay allowed (the engine
        learns of the termination from the results one step later when steps overlap)."""
        row = self._stop_only_rows.get(id(backend))
        if row is None:
            row = np.zeros(self.channel.geometry.mask_words, np.uint32)
            for token in backend.stop_token_ids:
                if token < self.channel.geometry.vocab_size:
                    row[token >> 5] |= np.uint32(1 << (token & 31))
            row = self._stop_only_rows[id(backend)] = row.view(np.int32)
        return row

    @staticmethod
    def _batch_fill(items: list[T], row_of, matcher_of, backend_of, single: GrammarBackend | None,
                    masks: np.ndarray, max_pos: int, position: int) -> list[int]:
        """One batch_fill per backend of the mask rows at `position` of the items' rows; returns
        the mask row indices written."""
        written: list[int] = []
        for backend, group in by_backend(items, backend_of, single):
            indices = [row_of(i) * max_pos + position for i in group]
            backend.batch_fill([matcher_of(i) for i in group], masks, indices)
            written.extend(indices)
        return written

    @staticmethod
    def _batch_accept(items: list[T], matcher_of, backend_of, token_of,
                      single: GrammarBackend | None, advance: bool = False) -> list[tuple[T, bool]]:
        """One batch_accept (advance: batch_advance, a refusing matcher is dropped) per
        backend; (item, accepted) pairs in backend-group order."""
        out: list[tuple[T, bool]] = []
        for backend, group in by_backend(items, backend_of, single):
            accept = backend.batch_advance if advance else backend.batch_accept
            accepted = accept([matcher_of(i) for i in group], [token_of(i) for i in group])
            out.extend(zip(group, accepted))
        return out

    def _reset_stale(self, step: int, filled: set[int]) -> None:
        """Rows that held a grammar mask on this entry's last use and not now become all ones."""
        k = step % self.channel.geometry.depth
        stale = self._dirty[k] - filled
        if stale:
            self.channel.entry(step).masks[sorted(stale)] = -1
        self._dirty[k] = filled
