"""A slow row is late alone (slow_rows.py): the others of its step get their masks, and the
masks it gets later are those of the same state filled on time.

The slowness is GrammarServiceConfig.slow_fill_ms on grammars marked by slow_fill_marker: every
fill of the marked grammar sleeps SLOW_MS first, forty times the slow threshold at FORWARD_US,
and the driver's forward is done as soon as a step starts (forward_seq beside inputs_seq), so a
slow fill is not done in its step however the machine is loaded."""
from __future__ import annotations

import time

import numpy as np
import pytest

from channel_driver import Row, is_allowed
from grammar_service.config import GrammarServiceConfig
from grammar_service.service import GrammarService
from grammar_service.slow_filler import SlowFiller
from real_tokenizers import continuation_ids
from step_channel import ERR_NONE, VALID_LATE

VOCAB = 32768
SLOW_MS = 200
FORWARD_US = 20_000
MARKER = "slow-row-test"
FAST = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"]}
SLOW = {"type": "object", "description": MARKER, "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def service(mistral_32k_dir):
    """conftest's `driver` and `compile_id` run on this service."""
    svc = GrammarService(GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB,
                                              slow_fill_ms=SLOW_MS, slow_fill_marker=MARKER,
                                              isolate_compiles=False))
    yield svc
    svc.close()


def _reference_masks(service, grammar_id: int, ids: list[int]) -> list[np.ndarray]:
    """The mask before each token of `ids` (and after the last), filled by a matcher of its own."""
    backend, compiled = service._lookup_grammar(grammar_id)
    matcher = backend.new_matcher(compiled)
    masks = np.zeros((len(ids) + 1, VOCAB // 32), np.int32)
    for k, token in enumerate(ids):
        backend.batch_fill([matcher], masks, [k])
        assert matcher.accept(token)
    backend.batch_fill([matcher], masks, [len(ids)])
    return list(masks)


def test_a_slow_row_is_late_alone_and_gets_the_masks_it_would_have_had(driver, compile_id, mistral_32k, service):
    fast, slow = compile_id("json_schema", FAST), compile_id("json_schema", SLOW)
    fast_ids = continuation_ids(mistral_32k, '{"name": "Ada Lovelace", "age": 36}')
    slow_ids = continuation_ids(mistral_32k, '{"n": 7}')
    reference = _reference_masks(service, slow, slow_ids)
    # Step 1: each row's first fill is timed alone on the step's path (so not late); the
    # marked one takes SLOW_MS, more than a quarter of FORWARD_US: it is slow from now on.
    view = driver.step([Row.fresh(0, fast), Row.fresh(1, slow)], forward_us=FORWARD_US)
    assert view.valid_positions.tolist() == [1, 1]
    assert is_allowed(view.masks[0, 0], fast_ids[0])
    np.testing.assert_array_equal(view.masks[1, 0], reference[0])
    driver.finish([[fast_ids[0]], [slow_ids[0]]])
    num_slow, num_late = 1, 0
    for f in range(1, len(fast_ids)):  # the fast row gets its mask every step
        view = driver.step([Row(0), Row(1)], forward_us=FORWARD_US)
        assert view.results[:, 1].tolist() == [ERR_NONE, ERR_NONE]
        assert view.valid_positions[0] == 1 and is_allowed(view.masks[0, 0], fast_ids[f])
        tokens = [[fast_ids[f]], []]
        if view.valid_positions[1] == VALID_LATE:  # nothing accepted: its state does not move
            num_late += 1
        else:
            assert view.valid_positions[1] == 1
            np.testing.assert_array_equal(view.masks[1, 0], reference[num_slow])
            tokens[1] = [slow_ids[num_slow]]
            num_slow += 1
        driver.finish(tokens)
    assert num_late >= 1, "a slow fill SLOW_MS long was never late"
    assert num_slow < len(fast_ids) - 1, "the slow row kept pace with the fast one"
    while num_slow < len(slow_ids):  # the slow row alone, on to the end of its document
        view = driver.step([Row(1)], forward_us=FORWARD_US)
        tokens = [[]]
        if view.valid_positions[0] != VALID_LATE:
            np.testing.assert_array_equal(view.masks[0, 0], reference[num_slow])
            tokens = [[slow_ids[num_slow]]]
            num_slow += 1
        driver.finish(tokens)
    view = driver.step([Row(1)])  # no deadline (a GPU step): the row waits for its mask, never late
    assert view.valid_positions.tolist() == [1]
    np.testing.assert_array_equal(view.masks[0, 0], reference[len(slow_ids)])


def test_without_a_deadline_no_row_is_late(driver, compile_id, mistral_32k):
    slow = compile_id("json_schema", SLOW)
    ids = continuation_ids(mistral_32k, '{"n": 7}')
    view = driver.step([Row.fresh(2, slow)])
    for token in ids[:3]:
        assert view.valid_positions.tolist() == [1] and is_allowed(view.masks[0, 0], token)
        driver.finish([[token]])
        view = driver.step([Row(2)])


def test_a_slow_row_late_once_has_its_next_fill_started_when_it_advances_so_it_can_sit_out(
        driver, compile_id, mistral_32k, service):
    """The engine leaves a row that was late out of steps while its next mask is likely being
    filled (generation_service/engine/late_mask.py): that fill must already be under way, so the
    step that takes the row back gets its mask at once, the same as one filled on time. Before
    it was ever late nothing is filled ahead: the engine learns that a row is slow from its
    being late alone."""
    fast, slow = compile_id("json_schema", FAST), compile_id("json_schema", SLOW)
    fast_ids = continuation_ids(mistral_32k, '{"name": "Ada Lovelace", "age": 36}')
    slow_ids = continuation_ids(mistral_32k, '{"n": 7}')
    reference = _reference_masks(service, slow, slow_ids)
    view = driver.step([Row.fresh(0, fast), Row.fresh(3, slow)], forward_us=FORWARD_US)  # timed: slow
    assert view.valid_positions.tolist() == [1, 1]
    driver.finish([[fast_ids[0]], [slow_ids[0]]])
    view = driver.step([Row(0)], forward_us=FORWARD_US)  # it advances by slow_ids[0] here
    driver.finish([[fast_ids[1]]])
    time.sleep(2 * SLOW_MS / 1000)
    view = driver.step([Row(0), Row(3)], forward_us=FORWARD_US)  # never late yet: its fill starts now
    assert view.valid_positions.tolist() == [1, VALID_LATE]
    driver.finish([[fast_ids[2]], []])
    time.sleep(2 * SLOW_MS / 1000)
    view = driver.step([Row(0), Row(3)], forward_us=FORWARD_US)
    assert view.valid_positions.tolist() == [1, 1]
    np.testing.assert_array_equal(view.masks[1, 0], reference[1])
    driver.finish([[fast_ids[3]], [slow_ids[1]]])
    for f in range(4, 6):  # the slow row sits out; its state advances by slow_ids[1] in the first of these
        view = driver.step([Row(0)], forward_us=FORWARD_US)
        assert view.valid_positions.tolist() == [1]
        driver.finish([[fast_ids[f]]])
    time.sleep(2 * SLOW_MS / 1000)  # longer than its fill
    view = driver.step([Row(0), Row(3)], forward_us=FORWARD_US)  # the forward is done at once
    assert view.valid_positions.tolist() == [1, 1], "the row that sat out found its fill not even started"
    np.testing.assert_array_equal(view.masks[1, 0], reference[2])
    driver.finish([[fast_ids[6]], [slow_ids[2]]])


def test_a_short_slow_fill_does_not_wait_behind_a_long_one(compile_id, service):
    """A row slow against a short forward (a string state on a small model) is filled apart
    too: its fill must not queue behind an adversarial row's (slow_filler.py)."""
    backend, compiled = service._lookup_grammar(compile_id("json_schema", FAST))
    filler = SlowFiller(VOCAB // 32, "test")
    try:
        long = filler.submit(backend.new_matcher(compiled), backend, delay_s=SLOW_MS / 1e3)
        short = filler.submit(backend.new_matcher(compiled), backend)
        assert short.done.wait(SLOW_MS / 1e3 / 2) and not long.done.is_set()
        assert long.done.wait(5) and long.error is short.error is None
        np.testing.assert_array_equal(short.mask, long.mask)  # the same state, filled by either thread
    finally:
        filler.close()
