"""grammar_step.py's engine side of the step channel and its two kinds of workload: `Engine`
writes each step's descriptors, publishes inputs_seq and times the wait for the masks;
`run_replay` replays tokenized JSON documents (with drafts or not), `run_random` walks each row
to a uniformly random allowed token of its own mask. Assumes grammar_step.py has put the
repository root and tests/ on sys.path.
"""
from __future__ import annotations

import time

import numpy as np

from channel_driver import ChannelDriver, Row
from step_channel import FLAG_CONSTRAINED, FLAG_FRESH

MAX_POSITIONS = 4
EOS = 2  # "</s>" in both Mistral vocabularies
RANDOM_WALK_MAX_TOKENS = 256


class Engine(ChannelDriver):
    """The engine side of the channel (tests/channel_driver.py's `finish`), timing each step from
    inputs_seq published to the masks seen."""

    def step(self, rows: list[Row]) -> tuple[float, object]:
        self.step_no += 1
        e = self.channel.entry(self.step_no)
        e.desc_header[:] = (self.step_no, len(rows))
        for r, row in enumerate(rows):
            e.desc_rows[r] = (row.slot, row.num_positions, row.flags, row.grammar_id)
            if row.drafts:
                e.drafts[r, :len(row.drafts)] = row.drafts
        started = time.perf_counter()
        self.channel.publish_seq("inputs_seq", self.step_no)
        if not self.channel.wait_seq("mask_seq", self.step_no, timeout_s=30, spin_s=20e-6, max_sleep_s=20e-6):
            raise TimeoutError(f"no masks for step {self.step_no}")
        return (time.perf_counter() - started) * 1e6, e


def _check_results(e, batch: int) -> None:
    errors = e.results[:batch, 1]
    if errors.any():
        raise RuntimeError(f"grammar_service reported errors {errors.tolist()}: the replay is out of sync")


def run_replay(engine: Engine, grammar_ids, docs_ids, batch: int, num_steps: int, num_drafts: int) -> list[float]:
    """Row r replays document r % len(docs) from its start; a finished row restarts. The rows of
    one document move in lockstep (the same state every step), so about batch / len(docs) rows
    reach a costly position in the same step."""
    ndocs = len(docs_ids)
    doc = [r % ndocs for r in range(batch)]
    pos = [0] * batch
    fresh = [True] * batch
    times = []
    for step in range(num_steps):
        rows = []
        for r in range(batch):
            ids = docs_ids[doc[r]]
            # mask p constrains the token after drafts[:p]: the drafts are the next tokens
            drafts = ids[pos[r]: min(pos[r] + num_drafts, len(ids) - 1)]  # never the stop token
            flags = FLAG_CONSTRAINED | (FLAG_FRESH if fresh[r] else 0)
            rows.append(Row(r, 1 + len(drafts), flags, grammar_ids[doc[r]], drafts))
        elapsed, e = engine.step(rows)
        _check_results(e, batch if step else 0)
        if list(e.valid_positions[:batch]) != [row.num_positions for row in rows]:
            raise RuntimeError("a draft of a valid document was refused: the replay is out of sync")
        times.append(elapsed)
        accepted = []
        for r in range(batch):
            ids = docs_ids[doc[r]]
            take = ids[pos[r]: pos[r] + len(rows[r].drafts) + 1]  # the drafts + the bonus token
            accepted.append(take)
            pos[r] += len(take)
            fresh[r] = False
            if pos[r] >= len(ids):  # the stop token went out: next step starts another document
                doc[r], pos[r], fresh[r] = (doc[r] + 1) % ndocs, 0, True
        engine.finish(accepted)
    return times


def popcount32(words: np.ndarray) -> np.ndarray:
    """Set bits per uint32 (SWAR; np.bitwise_count needs numpy >= 2, the device image may not)."""
    v = words - ((words >> 1) & np.uint32(0x55555555))
    v = (v & np.uint32(0x33333333)) + ((v >> 2) & np.uint32(0x33333333))
    return (((v + (v >> 4)) & np.uint32(0x0F0F0F0F)) * np.uint32(0x01010101)) >> 24


def sample_allowed(masks: np.ndarray, rng: np.random.Generator) -> list[int]:
    """One uniformly random allowed token per mask row (int32 words, bit t = token t), EOS only
    when nothing else is allowed. Vectorised: unpacking each row in Python dominated the
    benchmark's wall time at 128 rows of a 131k vocabulary (not its figures)."""
    words = masks.view(np.uint32).copy()
    counts = popcount32(words).sum(axis=1, dtype=np.int64)
    eos_word, eos_bit = EOS >> 5, np.uint32(1 << (EOS & 31))
    drop_eos = (counts > 1) & ((words[:, eos_word] & eos_bit) != 0)
    words[drop_eos, eos_word] &= ~eos_bit
    counts -= drop_eos
    k = (rng.random(len(words)) * counts).astype(np.int64)  # each row's k-th allowed token (0-based)
    cum = np.cumsum(popcount32(words), axis=1, dtype=np.int64)
    word = (cum <= k[:, None]).sum(axis=1)  # the word holding it
    before = np.where(word > 0, cum[np.arange(len(words)), np.maximum(word - 1, 0)], 0)
    tokens = []
    for row, (w, rank) in enumerate(zip(word.tolist(), (k - before).tolist())):
        bits = int(words[row, w])
        for _ in range(rank):
            bits &= bits - 1  # clear the lowest set bit
        tokens.append(w * 32 + (bits & -bits).bit_length() - 1)
    return tokens


def run_random(engine: Engine, grammar_ids, batch: int, num_steps: int, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    fresh, length = [True] * batch, [0] * batch
    gid = [grammar_ids[r % len(grammar_ids)] for r in range(batch)]
    times = []
    for step in range(num_steps):
        rows = [Row(r, 1, FLAG_CONSTRAINED | (FLAG_FRESH if fresh[r] else 0), gid[r]) for r in range(batch)]
        elapsed, e = engine.step(rows)
        _check_results(e, batch if step else 0)
        times.append(elapsed)
        tokens = []
        for r, token in enumerate(sample_allowed(e.masks[:batch * MAX_POSITIONS:MAX_POSITIONS], rng)):
            tokens.append([token])
            length[r] += 1
            fresh[r] = False
            if token == EOS or length[r] >= RANDOM_WALK_MAX_TOKENS:
                fresh[r], length[r] = True, 0
        engine.finish(tokens)
    return times
