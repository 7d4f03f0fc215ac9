"""The overlapped step (loop.py: `_overlapped_step`) against the serial one, byte for byte.

Two StepLoops, one per mode, each on its own channel, see the same descriptors and the same
accepted tokens: random walks over real JSON grammars with the llguidance backend on the real
131k Tekken vocabulary, with restarts, releases, rejected tokens, unconstrained rows, shuffled
row order and steps with drafts (which take the serial path in both). Every step's masks,
valid positions and results must be equal; the overlapped loop also advances through
`batch_advance` (llguidance's parallel consume) where the serial one uses `batch_accept`.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from channel_driver import allowed_tokens
from generation_service.engine.params import GrammarSpec
from grammar_service.loop import StepLoop
from grammar_service.tokenizer import load_tokenizer
from step_channel import FLAG_CONSTRAINED, FLAG_FRESH, FLAG_RELEASE, Geometry, StepChannel

llguidance_backend = pytest.importorskip("grammar_service.backends.llguidance")

VOCAB = 131072
EOS = 2  # "</s>" in Tekken
GEOMETRY = Geometry(max_batch=48, max_positions=3, vocab_size=VOCAB)
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "cd"]}},
                                      "ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "array", "items": {"type": "number"}, "maxItems": 4},
]


class _Pair:
    """A serial and an overlapped loop, each on its own channel, fed the same inputs."""

    def __init__(self, lookup):
        self.channels = [StepChannel.create(GEOMETRY) for _ in range(2)]
        self.loops = [StepLoop(c, 64, 1, lookup, mode=m) for c, m in zip(self.channels, ("serial", "overlap"))]
        self.step_no = 0

    def step(self, rows: list[tuple[int, int, int, int, list[int]]]):
        """Run step N on both loops; the serial loop's entry (the overlapped one checked equal)."""
        self.step_no += 1
        n, views = self.step_no, []
        for chan, loop in zip(self.channels, self.loops):
            e = chan.entry(n)
            e.desc_header[:] = (n, len(rows))
            for r, (slot, num_positions, flags, grammar_id, drafts) in enumerate(rows):
                e.desc_rows[r] = (slot, num_positions, flags, grammar_id)
                e.drafts[r, :len(drafts)] = drafts
            loop.run_step(n)
            views.append(e)
        serial, overlapped = views
        num_rows = len(rows) * GEOMETRY.max_positions
        assert serial.masks[:num_rows].tobytes() == overlapped.masks[:num_rows].tobytes(), f"step {n}: masks"
        assert serial.valid_positions[:len(rows)].tolist() == overlapped.valid_positions[:len(rows)].tolist()
        assert serial.results[:64].tolist() == overlapped.results[:64].tolist(), f"step {n}: results"
        return serial

    def finish(self, tokens: list[list[int]]) -> None:
        for chan in self.channels:
            e = chan.entry(self.step_no)
            for r, row_tokens in enumerate(tokens):
                e.out_counts[r] = len(row_tokens)
                e.out_tokens[r, :len(row_tokens)] = row_tokens

    def close(self) -> None:
        for loop, chan in zip(self.loops, self.channels):
            loop.stop()
            chan.close()


@pytest.fixture(scope="module")
def backend(tekken_131k_dir):
    data, _ = load_tokenizer(tekken_131k_dir, VOCAB)
    return llguidance_backend.LLGuidanceBackend(data, num_compile_threads=1, num_fill_threads=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_overlapped_step_writes_what_the_serial_step_writes(backend, seed):
    grammars = [backend.compile(GrammarSpec("json_schema", json.dumps(s), backend="llguidance")) for s in SCHEMAS]
    pair = _Pair(lambda gid: (backend, grammars[gid - 1]) if 1 <= gid <= len(grammars) else None)
    rng = np.random.default_rng(seed)
    # per slot: "free" | "fresh" | "live" | "done" (release next step) | "free-run" (unconstrained)
    status = {s: "fresh" for s in range(36)} | {s: "free-run" for s in range(36, 40)}
    grammar_of, length, prev_mask = {}, {}, {}
    try:
        for n in range(1, 91):
            with_drafts = n % 9 == 0
            rows = []
            for slot in rng.permutation(48).tolist():
                st = status.get(slot, "free")
                if st == "free-run":
                    rows.append((slot, 1, 0, 0, []))
                elif st == "done":
                    rows.append((slot, 0, FLAG_RELEASE, 0, []))
                    status[slot] = "fresh" if rng.random() < 0.7 else "free"
                elif st == "fresh":
                    grammar_of[slot], length[slot] = int(rng.integers(1, 5)), 0  # id 4: unknown grammar
                    rows.append((slot, 1, FLAG_CONSTRAINED | FLAG_FRESH, grammar_of[slot], []))
                    status[slot] = "live"
                elif st == "live":
                    drafts = []
                    if with_drafts and slot in prev_mask:  # plausible drafts: allowed one step earlier
                        drafts = [int(t) for t in rng.choice(prev_mask[slot], 2)]
                    release = FLAG_RELEASE if rng.random() < 0.02 else 0
                    rows.append((slot, 1 + len(drafts), FLAG_CONSTRAINED | release, grammar_of[slot], drafts))
                    if release:
                        status[slot] = "free"
                elif rng.random() < 0.05:
                    status[slot] = "fresh"  # picked up next step
            e = pair.step(rows)
            tokens = []
            for r, (slot, num_positions, flags, _, drafts) in enumerate(rows):
                valid = int(e.valid_positions[r])
                if not flags & FLAG_CONSTRAINED or valid == 0 or num_positions == 0:
                    tokens.append([int(rng.integers(3, VOCAB))] if flags == 0 else [])
                    if flags & FLAG_CONSTRAINED and status.get(slot) == "live":
                        status[slot] = "done"  # no matcher (unknown grammar, rejected token)
                    continue
                allowed = allowed_tokens(e.masks[r * GEOMETRY.max_positions + valid - 1])
                prev_mask[slot] = allowed
                if rng.random() < 0.03:
                    last = int(rng.integers(3, VOCAB))  # most likely outside the mask: rejected
                else:
                    choices = allowed[allowed != EOS] if len(allowed) > 1 and rng.random() < 0.9 else allowed
                    last = int(rng.choice(choices))
                tokens.append(drafts[:valid - 1] + [last])
                length[slot] += valid
                if status.get(slot) == "live" and (last == EOS or length[slot] > 40):
                    status[slot] = "done"
            pair.finish(tokens)
        overlapped = pair.loops[1]
        assert overlapped.num_overlapped_steps > 60  # the others had drafts or came right after them
        assert pair.loops[0].num_overlapped_steps == 0
        assert overlapped.phases.advance_ns > 0 and overlapped.phases.fill_ns > 0
    finally:
        pair.close()
