"""The engine side of a step channel, without a GPU: tests and benchmarks drive grammar_service with it.

Per grammar step N: `step(rows)` writes descriptor N and the drafts, publishes
`inputs_seq = N` (promising step N-1's outputs are written), waits `mask_seq >= N` and
returns views of what grammar_service wrote; `finish(tokens)` then writes step N's
accepted tokens and `outputs_seq = N`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from step_channel import FLAG_CONSTRAINED, FLAG_FRESH, FLAG_RELEASE, StepChannel


@dataclass
class Row:
    slot: int
    num_positions: int = 1
    flags: int = FLAG_CONSTRAINED
    grammar_id: int = 0
    drafts: list[int] = field(default_factory=list)

    @classmethod
    def fresh(cls, slot: int, grammar_id: int, drafts: list[int] | None = None) -> "Row":
        drafts = drafts or []
        return cls(slot, 1 + len(drafts), FLAG_CONSTRAINED | FLAG_FRESH, grammar_id, drafts)

    @classmethod
    def release_only(cls, slot: int) -> "Row":
        return cls(slot, 0, FLAG_RELEASE)


@dataclass
class StepView:
    masks: np.ndarray            # (batch, max_positions, mask_words) copy
    valid_positions: np.ndarray  # (batch,)
    results: np.ndarray          # (previous batch, 2) terminated_at, error
    mask_status: int
    forced: list[list[int]] = field(default_factory=list)  # per row: its forced run (FLAG_FORCED_DRAFTS)


def allowed_tokens(mask_row: np.ndarray) -> np.ndarray:
    """Token ids whose bit is set in one mask row."""
    return np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little"))


def is_allowed(mask_row: np.ndarray, token_id: int) -> bool:
    return bool((int(mask_row[token_id >> 5]) >> (token_id & 31)) & 1)


class ChannelDriver:
    def __init__(self, channel: StepChannel, first_step: int = 1):
        self.channel = channel
        self.step_no = first_step - 1
        self._prev_batch = 0

    def step(self, rows: list[Row], timeout_s: float = 10.0, forward_us: int = 0) -> StepView:
        """`forward_us`: the engine's forward time, whose forward is done at once here
        (`forward_seq = N` beside `inputs_seq`: a slow row whose mask is not ready is late);
        0: grammar_service waits for every row."""
        self.step_no += 1
        n, g = self.step_no, self.channel.geometry
        e = self.channel.entry(n)
        e.desc_header[:] = (n, len(rows))
        e.forward_us[0] = forward_us
        for r, row in enumerate(rows):
            e.desc_rows[r] = (row.slot, row.num_positions, row.flags, row.grammar_id)
            if row.drafts:
                e.drafts[r, :len(row.drafts)] = row.drafts
        self.channel.publish_seq("inputs_seq", n)
        if forward_us:
            self.channel.publish_seq("forward_seq", n)
        if not self.channel.wait_seq("mask_seq", n, timeout_s=timeout_s, spin_s=1e-3, max_sleep_s=50e-6):
            raise TimeoutError(f"grammar_service did not publish masks of step {n} in {timeout_s} s")
        view = StepView(
            masks=e.masks[:len(rows) * g.max_positions].reshape(len(rows), g.max_positions, -1).copy(),
            valid_positions=e.valid_positions[:len(rows)].copy(),
            results=e.results[:self._prev_batch].copy(), mask_status=int(e.mask_status[0]),
            forced=[e.forced_tokens[r, :e.forced_counts[r]].tolist() for r in range(len(rows))])
        self._prev_batch = len(rows)
        return view

    def finish(self, tokens: list[list[int]]) -> None:
        """Step N's accepted tokens per row (in row order), then outputs_seq = N."""
        e = self.channel.entry(self.step_no)
        for r, row_tokens in enumerate(tokens):
            e.out_counts[r] = len(row_tokens)
            e.out_tokens[r, :len(row_tokens)] = row_tokens
        self.channel.publish_seq("outputs_seq", self.step_no)
