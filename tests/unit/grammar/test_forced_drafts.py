"""Forced runs through a real step channel (FLAG_FORCED_DRAFTS, the grammar proposer's source):
a walk that drafts them gives the tokens and masks of one-token-at-a-time decoding."""
from __future__ import annotations

import json

import numpy as np
import pytest

from channel_driver import Row, allowed_tokens, is_allowed
from forced_structure import SHIPMENT
from generation_service.engine.request import ForcedRun
from real_tokenizers import continuation_ids
from step_channel import FLAG_CONSTRAINED, FLAG_FORCED_DRAFTS, FLAG_FRESH

EOS = 2
MAX_DRAFTS = 3  # the conftest geometry's max_positions - 1


DOCUMENT = ('{"customer_account_identifier":"ACC-0000000002","shipping_status_description":'
            '"returned_to_the_warehouse","schema_version":"structgen.forced-drafts.v1","is_priority_shipment":false}')


def canonical(tokenizer):
    """A deterministic 'model' that writes DOCUMENT spelled as the tokenizer spells it (as a
    trained model mostly does)."""
    document = continuation_ids(tokenizer, DOCUMENT) + [EOS]

    def pick(tokens: list[int], mask_row: np.ndarray) -> int:
        assert tokens == document[:len(tokens)] and is_allowed(mask_row, document[len(tokens)])
        return document[len(tokens)]
    return pick


def longest_token(tokenizer):
    """A deterministic 'model' that picks the allowed token with the longest name (then the
    lowest id; byte tokens such as "<0x5F>" win): mostly not the drafts, which it rejects."""
    def pick(tokens: list[int], mask_row: np.ndarray) -> int:
        return max(allowed_tokens(mask_row).tolist(), key=lambda t: (len(tokenizer.id_to_token(t)), -t))
    return pick


def decode(driver, grammar_id, pick, *, forced_drafts: bool, max_steps: int = 400):
    """Decode one row to its stop token as the engine does: drafts from the last forced run
    (when they continue the tokens), verified greedily against `pick` of each position's
    mask. Returns (tokens, the mask each token was picked from, forced drafts accepted)."""
    tokens: list[int] = []
    masks: list[np.ndarray] = []
    run, num_accepted = None, 0
    flags = FLAG_CONSTRAINED | (FLAG_FORCED_DRAFTS if forced_drafts else 0)
    for step in range(max_steps):
        drafts = run.after(tokens)[:MAX_DRAFTS] if run is not None else []
        view = driver.step([Row(0, 1 + len(drafts), flags | (FLAG_FRESH if step == 0 else 0), grammar_id, drafts)])
        valid = int(view.valid_positions[0])
        assert valid >= 1
        out = []
        for p in range(valid):  # accept draft p while it is the model's pick there
            out.append(pick(tokens + out, view.masks[0, p]))
            masks.append(view.masks[0, p])
            if p == len(drafts) or out[-1] != drafts[p]:
                break
        num_accepted += len(out) - 1
        if forced_drafts:
            forced = view.forced[0]
            if forced:  # the run starts at the last exact position: its mask allows it
                assert is_allowed(view.masks[0, valid - 1], forced[0])
            run = ForcedRun(len(tokens) + valid - 1, tuple(forced))
        else:
            assert view.forced[0] == []  # only rows that ask get a run
        tokens += out
        driver.finish([out])
        if out[-1] == EOS:
            return tokens, masks, num_accepted
    raise AssertionError(f"no stop token in {max_steps} steps")


@pytest.mark.parametrize("model", ["canonical", "longest_token"])
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_forced_draft_walk_equals_one_token_at_a_time(driver, compile_id, mistral_32k, backend, model):
    grammar_id = compile_id("json_schema", SHIPMENT, any_whitespace=False, backend=backend)
    pick = {"canonical": canonical, "longest_token": longest_token}[model](mistral_32k)
    plain, plain_masks, _ = decode(driver, grammar_id, pick, forced_drafts=False)
    walked, walked_masks, num_accepted = decode(driver, grammar_id, pick, forced_drafts=True)
    assert walked == plain
    assert len(walked_masks) == len(plain_masks)
    for t, (a, b) in enumerate(zip(walked_masks, plain_masks)):
        np.testing.assert_array_equal(a, b, f"mask of token {t}")
    document = json.loads(mistral_32k.decode(plain[:-1]))
    assert document["schema_version"] == "structgen.forced-drafts.v1"
    if model == "canonical":  # the document is mostly forced: most of its tokens came as drafts
        assert document == json.loads(DOCUMENT)
        assert num_accepted >= len(walked) // 2, (num_accepted, len(walked))


def test_forced_run_starts_where_the_walk_stopped(driver, compile_id, mistral_32k):
    schema = {"type": "object", "properties": {"status": {"const": "shipped"}}, "required": ["status"]}
    grammar_id = compile_id("json_schema", schema, any_whitespace=False)
    whole = continuation_ids(mistral_32k, '{"status":"shipped"}')
    forced_flags = FLAG_CONSTRAINED | FLAG_FRESH | FLAG_FORCED_DRAFTS
    rows = [Row(0, 3, forced_flags, grammar_id, whole[:2]),           # drafts accepted: run after them
            Row(1, 3, forced_flags, grammar_id, [whole[0], 29473]),   # a draft rejected: run at it
            Row(2, 1, FLAG_CONSTRAINED | FLAG_FRESH, grammar_id)]     # not asked: no run
    view = driver.step(rows)
    assert view.valid_positions.tolist() == [3, 2, 1]
    assert view.forced[0] and whole[2:2 + len(view.forced[0])] == view.forced[0]
    assert view.forced[1] and whole[1:1 + len(view.forced[1])] == view.forced[1]
    assert view.forced[2] == []
    driver.finish([whole[:3], whole[:2], whole[:1]])
    # the walk rolled back: the runs did not move the matchers (the next step accepts the outputs)
    view = driver.step([Row(0, 1, FLAG_CONSTRAINED | FLAG_FORCED_DRAFTS), Row(1), Row(2)])
    assert view.results[:, 1].tolist() == [0, 0, 0]
    assert view.forced[0] == whole[3:3 + len(view.forced[0])]


def test_no_run_after_a_stop_draft_ended_the_grammar(driver, compile_id, mistral_32k):
    grammar_id = compile_id("regex", "(yes|no)")
    drafts = continuation_ids(mistral_32k, "yes") + [EOS]
    assert len(drafts) <= MAX_DRAFTS
    view = driver.step([Row(0, 1 + len(drafts), FLAG_CONSTRAINED | FLAG_FRESH | FLAG_FORCED_DRAFTS, grammar_id,
                            drafts)])
    assert view.valid_positions[0] == len(drafts)  # no position after the stop draft
    assert view.forced[0] == []


def test_a_row_timed_alone_on_a_host_step_gets_its_run_too(driver, compile_id, mistral_32k):
    """On host steps (forward_us set) a row's first fill is timed alone (slow_rows.py); it is
    still on the step's path, so its forced run is written as for a batch row."""
    grammar_id = compile_id("json_schema", SHIPMENT, any_whitespace=False)
    view = driver.step([Row(0, 1, FLAG_CONSTRAINED | FLAG_FRESH | FLAG_FORCED_DRAFTS, grammar_id)],
                       forward_us=1_000_000)
    assert view.valid_positions[0] == 1
    assert mistral_32k.decode(view.forced[0]).startswith('{"customer')
