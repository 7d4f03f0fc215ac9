"""SlowRows: which rows of a channel are slow, and their masks from the slow filler.

See docs/step_channel.md, "Late rows".

Only on steps whose descriptor gives `forward_us` (the engine's recent forward time; GPU steps
give 0 and every row waits, as before). Per fillable one-position row, `route` says where its
mask comes from:
- "timed": its first fill, and one in about every RETIME_EVERY, is filled alone on the step's
  path and timed; more than SLOW_FRACTION of the forward (and at least MIN_SLOW_FILL_NS) makes
  it slow;
- "apart": a slow row, or one whose slow fill is under way: filled in the slow filler
  (slow_filler.py) beside the step's batch fill. `collect` copies a fill done by the end of the
  engine's forward (forward_seq >= N: the engine waits from then on) into the step's entry;
  otherwise the row is late (VALID_LATE): the engine samples nothing for it this step and sends
  it again, so only that row waits for its mask. A slow fill under half the threshold makes the
  row fast again;
- "batch": every other row, in the step's batch calls.
A slow row that was late once has its next fill started as soon as its matcher advances
(`prefetch`): the engine leaves a late row out of steps while that fill is likely running
(engine/late_mask.py).
A row slow from its very first fill holds that one step (its timed fill). Rows with drafts are
never late: their positions walk in the batch (a pending slow fill is waited for first).
"""
from __future__ import annotations

import time

import numpy as np

from grammar_service import metrics
from grammar_service.slots import Slot, SlotTable
from grammar_service.slow_filler import SlowFill, SlowFiller
from step_channel import ERR_INTERNAL, VALID_LATE, StepChannel, seq_reached

SLOW_FRACTION = 0.25        # a row whose fill alone takes this share of the engine's forward is slow,
MIN_SLOW_FILL_NS = 250_000  # ...and at least this (most fills of an ordinary schema take tens of us)
RETIME_EVERY = 64           # a fast row's fill is timed alone again after about this many batch fills
LANE_POLL_S = 100e-6        # while a slow fill runs, forward_seq is looked at this often


class SlowRows:
    """The slow-row state of one channel's loop (its thread alone calls these, but `close`)."""

    def __init__(self, channel: StepChannel, slots: SlotTable, *, enabled: bool = True):
        self.channel = channel
        self.slots = slots
        self.enabled = enabled  # GrammarServiceConfig.isolate_slow_rows
        self.filler = SlowFiller(channel.geometry.mask_words, channel.name)
        self.num_late_rows = 0

    def close(self, timeout_s: float = 5.0) -> None:
        self.filler.close(timeout_s)

    def threshold_ns(self, forward_us: int) -> int:
        """The fill time from which a row is slow on a step with this `forward_us`; 0: no row
        may be late on it."""
        if not self.enabled or forward_us <= 0:
            return 0
        return max(MIN_SLOW_FILL_NS, int(SLOW_FRACTION * forward_us * 1000))

    @staticmethod
    def route(state: Slot, num_positions: int, slow_ns: int) -> str:
        """Where a fillable row's mask comes from: "batch", "timed" or "apart" (module doc)."""
        if state.slow_fill is not None:
            if num_positions == 1:
                return "apart"  # a fill of this very state is under way, or done and unread
            state.slow_fill.done.wait()  # NOTE: the draft walk must not move a matcher being filled
            state.slow_fill = None
        if not slow_ns or num_positions != 1:
            return "batch"
        if state.is_slow:
            return "apart"
        if not 0 <= state.num_fills_since_timed < RETIME_EVERY:
            return "timed"
        state.num_fills_since_timed += 1
        return "batch"

    def prefetch(self, advanced: list[Slot]) -> None:
        """Start the next fill of each slow row that was late once and just advanced: the engine
        leaves such a row out of steps while that fill runs (generation_service/engine/late_mask.py),
        so its next step finds the mask done instead of starting it. Only once late: the engine
        learns that a row is slow from that alone, and a row whose fills were always done in time
        would stay in its decode graphs, which wait for every mask."""
        if not self.enabled:
            return
        for state in advanced:
            if (state.is_slow and state.was_late and state.slow_fill is None and state.matcher is not None
                    and not state.is_terminated):
                state.slow_fill = self.filler.submit(state.matcher, state.backend, state.fill_delay_s)

    def start(self, apart: list[tuple[int, int, Slot]]) -> None:
        """Hand the rows filled apart (row, slot, state) without a fill under way to the filler."""
        for _, _, state in apart:
            if state.slow_fill is None:
                state.slow_fill = self.filler.submit(state.matcher, state.backend, state.fill_delay_s)

    @staticmethod
    def fill_timed(timed: list[tuple[int, int, Slot]], masks: np.ndarray, max_pos: int, slow_ns: int) -> list[int]:
        """Fill each row alone and decide from its time whether it is slow; returns the rows written."""
        written = []
        for r, slot, state in timed:
            started = time.perf_counter_ns()
            if state.fill_delay_s:
                time.sleep(state.fill_delay_s)
            state.backend.batch_fill([state.matcher], masks, [r * max_pos])
            state.is_slow = time.perf_counter_ns() - started > slow_ns
            # by slot, so that rows bound together are not all timed again in one step
            state.num_fills_since_timed = slot % RETIME_EVERY
            written.append(r * max_pos)
        return written

    def collect(self, step: int, apart: list[tuple[int, int, Slot]], masks: np.ndarray, max_pos: int,
                valid: list[int], slow_ns: int) -> list[int]:
        """Copy the slow fills done by the end of the step's forward (slow_ns 0: waits for all)
        into the step's rows and mark the others late in `valid`. Returns the rows written."""
        written = []
        for r, slot, state in apart:
            fill = state.slow_fill
            if not self._is_done(fill, step, slow_ns):
                valid[r] = VALID_LATE
                state.was_late = True
                self.num_late_rows += 1
                metrics.ROWS_LATE.inc()
                continue
            state.slow_fill = None
            if fill.error is not None:
                self.slots.fail(slot, ERR_INTERNAL)
                valid[r] = 0
                continue
            masks[r * max_pos] = fill.mask[0]
            written.append(r * max_pos)
            if slow_ns and fill.elapsed_ns < slow_ns / 2:  # well under: fast again
                state.is_slow, state.num_fills_since_timed = False, slot % RETIME_EVERY
        return written

    def _is_done(self, fill: SlowFill, step: int, slow_ns: int) -> bool:
        """Whether `fill` is done before the engine's forward of `step` is (slow_ns 0: waits for it)."""
        if not slow_ns:
            return fill.done.wait()
        while not fill.done.is_set():
            if seq_reached(self.channel.load_seq("forward_seq"), step):
                return fill.done.is_set()
            fill.done.wait(LANE_POLL_S)
        return True
