"""GrammarLink against a scripted grammar side (this test writes what grammar_service would)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from generation_service.engine.grammar_link import GrammarLink, LinkRow
from step_channel import (
    ERR_TOKEN_REJECTED, FLAG_CONSTRAINED, FLAG_FRESH, FLAG_RELEASE, MASK_RELEASED_BY_WATCHDOG, Geometry,
)
from tests.unit.engine.conftest import make_request


class FakeControl:
    def __init__(self):
        self.opened, self.closed, self.serving = [], [], True

    def open_channel(self, name, geometry, *, max_slots, first_step, tokenizer_dir, tokenizer_fingerprint):
        self.opened.append((name, first_step))

    def close_channel(self, name):
        self.closed.append(name)

    def is_serving(self):
        return self.serving


@pytest.fixture(autouse=True)
def _close_links():
    """Every link a test makes is closed (its /dev/shm region unlinked), pass or fail."""
    yield
    while _LINKS:
        _LINKS.pop().close()


_LINKS: list[GrammarLink] = []


def make_link(control, timeout_s=0.3):
    geometry = Geometry(max_batch=4, max_positions=3, vocab_size=64)
    link = GrammarLink(control, geometry, max_slots=4, tokenizer_dir="/tok", tokenizer_fingerprint="fp",
                       wait_timeout_s=timeout_s, reconnect_interval_s=0.01)
    _LINKS.append(link)
    assert link.connect()
    return link


def constrained(rid, slot, grammar_id=7):
    request = make_request(rid)
    request.spec = request.spec.__class__(rid, request.spec.prompt_ids, grammar=__import__(
        "grammar_contract.spec", fromlist=["GrammarSpec"]).GrammarSpec("regex", "a+"))
    request.slot, request.grammar_id = slot, grammar_id
    return request


def answer(link, step, fill, results=()):
    """Play grammar_service for `step`: masks row r*P+p := fill(r, p), results, mask_seq."""
    entry = link.channel.entry(step)
    for r in range(entry.batch_size):
        for p in range(entry.desc_rows[r, 1]):
            entry.masks[r * link.geometry.max_positions + p] = fill(r, p)
        entry.valid_positions[r] = entry.desc_rows[r, 1]
    entry.results[:] = (-1, 0)
    for r, error in results:
        entry.results[r] = (-1, error)
    entry.mask_status[0] = 0
    link.channel.beat()
    link.channel.publish_seq("mask_seq", step)


def test_descriptor_masks_outputs_and_previous_step_results():
    control = FakeControl()
    link = make_link(control)
    a, b = constrained("a", slot=2), make_request("b")
    rows = [LinkRow.sampling(a, [5, 6]), LinkRow.sampling(b, [9]), LinkRow.release(3)]
    step = link.begin(rows)
    entry = link.channel.entry(step)
    assert (step, entry.batch_size, link.channel.load_seq("inputs_seq")) == (1, 3, 1)
    assert entry.desc_rows[:3].tolist() == [[2, 3, FLAG_CONSTRAINED | FLAG_FRESH, 7], [-1, 2, 0, 0],
                                            [3, 0, FLAG_RELEASE, 0]]
    assert entry.drafts[0, :2].tolist() == [5, 6]
    answer(link, step, lambda r, p: 10 * r + p)
    masks = link.wait(step)
    # logits order: a's 3 positions, then b's 2 (the release row has none)
    assert masks.bitmask[:, 0].tolist() == [0, 1, 2, 10, 11]
    assert masks.results == [] and masks.valid_positions[id(a)] == 3
    link.publish(step, [[5, 4], [8], []])
    assert link.channel.load_seq("outputs_seq") == 1
    assert entry.out_counts[:3].tolist() == [2, 1, 0] and entry.out_tokens[0, :2].tolist() == [5, 4]

    a.is_matcher_bound = True
    step2 = link.begin([LinkRow.sampling(a, [])])
    assert link.channel.entry(step2).desc_rows[0, 2] == FLAG_CONSTRAINED  # no second FRESH
    answer(link, step2, lambda r, p: -1, results=[(0, ERR_TOKEN_REJECTED)])  # verdict on step 1's row 0
    masks = link.wait(step2)
    assert [(r.request, r.error) for r in masks.results] == [(a, ERR_TOKEN_REJECTED)]


def test_watchdog_releases_a_silent_step_and_the_link_reconnects():
    control = FakeControl()
    link = make_link(control, timeout_s=0.2)
    step = link.begin([LinkRow.sampling(constrained("a", slot=0), [])])
    entry = link.channel.entry(step)  # (holding a view keeps the mapping readable after close)
    control.serving = False
    start = time.monotonic()
    assert link.wait(step) is None  # nobody answers, no heartbeat
    assert 0.2 <= time.monotonic() - start < 2.0
    assert entry.mask_status[0] == MASK_RELEASED_BY_WATCHDOG
    assert not link.is_connected and link.num_disconnects == 1
    assert not link.maybe_reconnect()
    control.serving = True
    deadline = time.monotonic() + 5
    while not link.maybe_reconnect():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert control.opened[-1][1] == step + 1  # numbering continues: a new first_step
    assert control.opened[-1][0] != control.opened[0][0]  # in a fresh region
    assert control.closed == [control.opened[0][0]]  # the old channel is closed on the service


def test_a_step_left_open_is_published_empty():
    link = make_link(FakeControl())
    step = link.begin([LinkRow.sampling(constrained("a", slot=1), [])])
    entry = link.channel.entry(step)
    entry.out_counts[0] = 3  # stale outputs of the entry's previous use
    answer(link, step, lambda r, p: -1)
    link.abandon_open_step()
    assert entry.out_counts[0] == 0 and link.channel.load_seq("outputs_seq") == step
    assert np.all(entry.masks[0] == -1)
