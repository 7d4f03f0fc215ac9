"""llguidance lanes (backends/llguidance.py): a compiled grammar holds several matchers built
apart and hands copies out round robin. Matchers of different lanes must behave exactly as
copies of one template: same masks, same accepted and refused tokens, same rollbacks, in
batches whose rows the backend regroups by lane; the compile cache still holds one compiled
grammar per spec; GrammarServiceConfig.num_llguidance_lanes reaches the backend."""
from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.corpus import get_schema
from channel_driver import ChannelDriver, Row, is_allowed
from grammar_contract.spec import GrammarSpec
from grammar_service.backends.llguidance import LLGuidanceBackend
from grammar_service.config import GrammarServiceConfig
from grammar_service.service import GrammarService
from real_tokenizers import continuation_ids
from step_channel import Geometry, StepChannel
from structgen.tokenizer_identity import fingerprint_tokenizer_json

from backend_vocab import EOS, VOCAB

NUM_LANES = 3
# (schema, a document valid under it); the walk also tries "]" at every position (mostly refused)
WALKS = [
    ("github-discussion", {"title": "[Idea] ", "labels": ["x"], "body": [
        {"type": "markdown", "attributes": {"label": "Thanks!"}}]}),
    ({"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "string"}, "maxItems": 3}}, "required": ["name"]}, {"name": "Ada", "tags": ["a", "b"]}),
]


@pytest.fixture(scope="module")
def laned(tokenizer_data):
    """One grammar's matchers on NUM_LANES lanes, advanced in the fill threads (lane-sorted too)."""
    return LLGuidanceBackend(tokenizer_data, num_compile_threads=1, num_fill_threads=NUM_LANES,
                             min_parallel_advance_rows=1, num_llguidance_lanes=NUM_LANES)


@pytest.fixture(scope="module")
def one_lane(tokenizer_data):
    return LLGuidanceBackend(tokenizer_data, num_compile_threads=1, num_fill_threads=NUM_LANES,
                             num_llguidance_lanes=1)


def _spec(schema) -> GrammarSpec:
    return GrammarSpec("json_schema", get_schema(schema).text if isinstance(schema, str) else json.dumps(schema))


def _fill(backend, matchers) -> np.ndarray:
    """All matchers' masks in one batch_fill, matcher i into row 2 + i (rows 0-1 stay unwritten)."""
    masks = np.zeros((len(matchers) + 2, backend.tokenizer.mask_words), np.int32)
    backend.batch_fill(matchers, masks, [2 + i for i in range(len(matchers))])
    assert not masks[:2].any()
    return masks[2:]


@pytest.mark.parametrize("schema,doc", WALKS, ids=lambda x: x if isinstance(x, str) else None)
def test_matchers_of_every_lane_behave_as_copies_of_one_template(laned, one_lane, mistral_32k, schema, doc):
    compiled, reference = laned.compile(_spec(schema)), one_lane.compile(_spec(schema))
    assert len(compiled.lanes) == NUM_LANES and len(reference.lanes) == 1
    # two matchers a lane, handed out round robin; rows given to the backend lanes interleaved
    rows = [laned.new_matcher(compiled) for _ in range(2 * NUM_LANES)]
    assert [m.lane for m in rows] == [0, 1, 2] * 2
    rows = rows[::-1]  # lanes 2, 1, 0, 2, 1, 0: batch_fill and batch_advance regroup them by lane
    copies = [one_lane.new_matcher(reference) for _ in rows]
    ids = continuation_ids(mistral_32k, json.dumps(doc))
    refused = continuation_ids(mistral_32k, "}]")[-1]
    masks_walked = []
    for token in ids:
        masks = _fill(laned, rows)
        np.testing.assert_array_equal(masks, _fill(one_lane, copies))
        assert (masks == masks[0]).all(), "rows in one state have one mask whatever their lane"
        masks_walked.append(masks[0].copy())
        allowed = is_allowed(masks[0], refused)
        assert laned.batch_accept(rows[:1], [refused]) == one_lane.batch_accept(copies[:1], [refused]) == [allowed]
        if allowed:  # undo it: the walk goes on with the document's token
            laned.batch_rollback(rows[:1], [1])
            one_lane.batch_rollback(copies[:1], [1])
        assert laned.batch_advance(rows, [token] * len(rows)) == [True] * len(rows)
        assert one_lane.batch_accept(copies, [token] * len(copies)) == [True] * len(copies)
    masks_walked.append(_fill(laned, rows)[0].copy())  # the document's end: EOS only
    assert laned.batch_advance(rows, [EOS] * len(rows)) == [True] * len(rows)
    assert all(m.is_terminated() for m in rows)
    # roll each row back by a different count, stop token included: its mask is the walk's
    back = [1 + 3 * k for k in range(len(rows))]
    laned.batch_rollback(rows, back)
    masks = _fill(laned, rows)
    for r, n in enumerate(back):
        np.testing.assert_array_equal(masks[r], masks_walked[len(ids) + 1 - n], f"row {r} back {n}")


def test_rows_of_several_states_keep_their_mask_rows_and_results(laned, mistral_32k):
    """Regrouping by lane moves (matcher, row) pairs together: each row still gets its own
    matcher's mask, and batch_advance's answers come back in the caller's order."""
    compiled = laned.compile(_spec(WALKS[1][0]))
    ids = continuation_ids(mistral_32k, json.dumps(WALKS[1][1]))
    rows = [laned.new_matcher(compiled) for _ in range(5)]  # lanes 0 1 2 0 1
    for r, m in enumerate(rows):  # row r walked r tokens: five states
        assert all(m.accept(t) for t in ids[:r])
    singles = [_fill(laned, [m])[0] for m in rows]
    np.testing.assert_array_equal(_fill(laned, rows), np.stack(singles))
    refused = continuation_ids(mistral_32k, "}]")[-1]
    tokens = [ids[r] if r % 2 == 0 else refused for r in range(5)]  # even rows accept, odd rows refuse
    assert laned.batch_advance(rows, tokens) == [True, False, True, False, True]


def test_compile_cache_keeps_one_compiled_grammar_with_its_lanes(mistral_32k_dir):
    svc = GrammarService(GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB, num_fill_threads=4,
                                              num_llguidance_lanes=NUM_LANES))
    try:
        spec = GrammarSpec("json_schema", json.dumps(WALKS[1][0]), backend="llguidance")
        first, again = svc.compile(spec).result(30), svc.compile(spec).result(30)
        assert not first.cache_hit and again.cache_hit
        assert again.entry.compiled is first.entry.compiled and len(first.entry.compiled.lanes) == NUM_LANES
        assert svc._compiler.stats.num_compiles == 1
    finally:
        svc.close()


@pytest.mark.parametrize("lanes,fill_threads,expected", [(0, 4, 1), (1, 4, 1), (3, 4, 3), (8, 2, 2)])
def test_the_configured_lanes_reach_the_backend_capped_at_its_fill_threads(mistral_32k_dir, lanes, fill_threads,
                                                                           expected):
    svc = GrammarService(GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB,
                                              num_fill_threads=fill_threads, num_llguidance_lanes=lanes))
    try:
        entry = svc.compile(GrammarSpec("json_schema", json.dumps(WALKS[1][0]), backend="llguidance")).result(30).entry
        assert svc._backend("llguidance").num_lanes == len(entry.compiled.lanes) == expected
    finally:
        svc.close()


def test_a_channels_rows_of_one_grammar_spread_over_the_lanes(mistral_32k_dir, mistral_32k):
    """Through the step loop: rows bound to one grammar in one step take lanes round robin and
    get the masks of a one-lane service."""
    geometry = Geometry(max_batch=4, max_positions=1, vocab_size=VOCAB)
    ids = continuation_ids(mistral_32k, json.dumps(WALKS[1][1])) + [EOS]
    masks_by_lanes = {}
    for lanes in (1, NUM_LANES):
        svc = GrammarService(GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB,
                                                  num_fill_threads=4, num_llguidance_lanes=lanes))
        chan = StepChannel.create(geometry)
        try:
            svc.open_channel(chan.name, geometry, max_slots=4, first_step=1, tokenizer_dir=mistral_32k_dir,
                             tokenizer_fingerprint=fingerprint_tokenizer_json(mistral_32k_dir, VOCAB))
            driver = ChannelDriver(chan)
            gid = svc.compile(GrammarSpec("json_schema", json.dumps(WALKS[1][0]), backend="llguidance")) \
                .result(30).entry.grammar_id
            views = [driver.step([Row.fresh(slot, gid) for slot in range(4)])]
            states = svc._loops[chan.name].slots.states
            assert [states[slot].matcher.lane for slot in range(4)] == [k % lanes for k in range(4)]
            for token in ids[:-1]:
                driver.finish([[token]] * 4)
                views.append(driver.step([Row(slot) for slot in range(4)]))
            masks_by_lanes[lanes] = np.stack([v.masks[:, 0] for v in views])
            svc.close_channel(chan.name)
        finally:
            chan.close()
            svc.close()
    np.testing.assert_array_equal(masks_by_lanes[NUM_LANES], masks_by_lanes[1])
