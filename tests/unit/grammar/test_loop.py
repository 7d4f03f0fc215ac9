"""Matcher slots driven through a real step channel on the real 32k Mistral tokenizer."""
from __future__ import annotations

import json

import numpy as np
import pytest
from prometheus_client import REGISTRY

from channel_driver import Row, allowed_tokens, is_allowed
from grammar_contract.spec import GrammarSpec
from grammar_service.loop import StepLoop
from real_tokenizers import continuation_ids
from step_channel import (
    ERR_NO_MATCHER, ERR_NONE, ERR_TOKEN_REJECTED, ERR_UNKNOWN_GRAMMAR, FLAG_CONSTRAINED, FLAG_FRESH, FLAG_RELEASE,
    MASK_OK, Geometry, StepChannel,
)

EOS = 2  # "</s>" in the Mistral vocabulary
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age"]}
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "[A-Z]{2}-[0-9]{4}"},
    "status": {"enum": ["open", "shipped", "closed"]},
    "lines": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
        "required": ["sku", "qty"]}}},
    "required": ["id", "status", "lines"]}
NESTED = {"type": "object", "properties": {"a": {"type": "object", "properties": {
    "b": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}, "c": {"type": "string", "format": "date"}},
    "required": ["b", "c"]}}, "required": ["a"]}
DOCS = [
    (PERSON, {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]}),
    (ORDER, {"id": "AB-1234", "status": "shipped",
             "lines": [{"sku": "x-1", "qty": 2, "price": 9.5}, {"sku": "ÿ ünï", "qty": 1}]}),
    (NESTED, {"a": {"b": None, "c": "2024-02-29"}}),
]


def _ones(mask_row: np.ndarray) -> bool:
    return bool((mask_row == -1).all())


def _replay(driver, grammar_ids, docs_ids):
    """Step all documents together one token per step; returns per-doc masks and final results."""
    rows = [Row.fresh(i, gid) for i, gid in enumerate(grammar_ids)]
    masks = [[] for _ in docs_ids]
    terminated = [None] * len(docs_ids)
    for t in range(max(map(len, docs_ids))):
        view = driver.step(rows)
        assert view.mask_status == MASK_OK
        for r, res in enumerate(view.results):
            assert res[1] == ERR_NONE, f"doc {r} step {t}: error {res[1]}"
            if res[0] >= 0:
                terminated[r] = t
        tokens = []
        for r, ids in enumerate(docs_ids):
            if t < len(ids):
                masks[r].append(view.masks[r, 0])
                tokens.append([ids[t]])
            else:
                tokens.append([])
        driver.finish(tokens)
        rows = [Row(i) for i in range(len(docs_ids))]
    view = driver.step(rows)
    for r, res in enumerate(view.results):
        if res[0] >= 0:
            terminated[r] = len(masks[0])
    return masks, terminated


def test_masks_allow_each_next_token_of_valid_documents(driver, compile_id, mistral_32k):
    docs_ids = [continuation_ids(mistral_32k, json.dumps(doc, ensure_ascii=False)) + [EOS] for _, doc in DOCS]
    grammar_ids = [compile_id("json_schema", schema) for schema, _ in DOCS]
    masks, _ = _replay(driver, grammar_ids, docs_ids)
    for ids, doc_masks in zip(docs_ids, masks):
        for t, (token, mask) in enumerate(zip(ids, doc_masks)):
            assert is_allowed(mask, token), f"token {t} ({mistral_32k.id_to_token(token)!r}) not allowed"
            assert not _ones(mask)
        # after the whole document only the stop token is allowed
        assert list(allowed_tokens(doc_masks[-1])) == [EOS]


def test_stop_token_reports_terminated_at(driver, compile_id, mistral_32k):
    gid = compile_id("regex", "(yes|no)")
    ids = continuation_ids(mistral_32k, "yes")
    driver.step([Row.fresh(0, gid, drafts=[])])
    driver.finish([ids + [EOS]])  # the whole answer accepted in one step (drafts verified)
    view = driver.step([Row(0, 2, FLAG_CONSTRAINED, 0, [EOS])])  # the engine has not seen the results yet
    assert view.results[0].tolist() == [len(ids), ERR_NONE]
    # a terminated matcher allows only the stop token and walks no drafts
    assert view.valid_positions[0] == 1 and list(allowed_tokens(view.masks[0, 0])) == [EOS]
    assert _ones(view.masks[0, 1])
    driver.finish([[EOS]])
    assert driver.step([Row(0)]).results.tolist() == [[-1, ERR_NONE]]  # tokens past the end are ignored


def test_token_outside_mask_is_an_error_row_and_drops_the_matcher(driver, compile_id, mistral_32k):
    gid = compile_id("json_schema", PERSON)
    view = driver.step([Row.fresh(0, gid), Row.fresh(1, gid)])
    bad = next(t for t in range(100, 32768) if not is_allowed(view.masks[0, 0], t))
    good = continuation_ids(mistral_32k, '{"')[0]
    driver.finish([[bad], [good]])
    view = driver.step([Row(0), Row(1)])
    assert view.results.tolist() == [[-1, ERR_TOKEN_REJECTED], [-1, ERR_NONE]]
    assert view.valid_positions.tolist() == [0, 1]
    assert _ones(view.masks[0, 0]) and not _ones(view.masks[1, 0])
    driver.finish([[good], [continuation_ids(mistral_32k, '{"name')[-1]]])
    view = driver.step([Row(1)])
    assert view.results.tolist() == [[-1, ERR_NO_MATCHER], [-1, ERR_NONE]]


def test_draft_walk_gives_the_rows_of_one_token_at_a_time(driver, compile_id, mistral_32k):
    gid = compile_id("json_schema", PERSON)
    ids = continuation_ids(mistral_32k, json.dumps(DOCS[0][1]))
    sequential, _ = _replay(driver, [gid], [ids[:8]])
    sequential = sequential[0]
    # Same document with 3 drafts per step; the verifier accepts 1 + 2 drafts each step,
    # so the matcher must roll back the third draft it walked.
    rows, pos = [Row(5, 4, FLAG_CONSTRAINED | 1, gid, ids[0:3])], 0
    while pos + 3 <= 8:
        view = driver.step(rows)
        assert view.valid_positions[0] == 4
        for p in range(4):
            np.testing.assert_array_equal(view.masks[0, p], sequential[pos + p], f"position {pos + p}")
        driver.finish([ids[pos:pos + 3]])
        pos += 3
        rows = [Row(5, 4, FLAG_CONSTRAINED, 0, ids[pos:pos + 3])]


def test_walk_stops_at_the_first_rejected_draft(driver, compile_id, mistral_32k):
    gid = compile_id("json_schema", PERSON)
    ids = continuation_ids(mistral_32k, '{"name": "x"}')
    view = driver.step([Row.fresh(0, gid, drafts=[ids[0], 29473, ids[2]])])  # "▁" is not allowed after '{"'
    assert not is_allowed(view.masks[0, 1], 29473)
    assert view.valid_positions[0] == 2
    assert _ones(view.masks[0, 2]) and _ones(view.masks[0, 3])
    driver.finish([[ids[0]]])
    view = driver.step([Row(0)])  # the rejected walk left the matcher where the outputs put it
    assert view.results[0].tolist() == [-1, ERR_NONE] and is_allowed(view.masks[0, 0], ids[1])


def test_rollback_restores_matcher_state(service, compile_id, mistral_32k):
    backend = service._backend("xgrammar")
    entry = service.compile(GrammarSpec("json_schema", json.dumps(PERSON), backend="xgrammar")).result(30).entry
    matcher = backend.new_matcher(entry.compiled)
    ids = continuation_ids(mistral_32k, '{"name": "Ada", "age": 3')
    masks = np.zeros((2, 1024), np.int32)
    for t in ids[:3]:
        assert matcher.accept(t)
    backend.batch_fill([matcher], masks, [0])
    for t in ids[3:]:
        assert matcher.accept(t)
    backend.batch_rollback([matcher], [len(ids) - 3])
    backend.batch_fill([matcher], masks, [1])
    np.testing.assert_array_equal(masks[0], masks[1])


def test_released_slot_is_reused_by_a_new_request(driver, compile_id, mistral_32k):
    person, choice = compile_id("json_schema", PERSON), compile_id("choice", choices=("red", "green"))
    driver.step([Row.fresh(3, person)])
    driver.finish([continuation_ids(mistral_32k, '{"')])
    # step 2: the request finished; its slot is released and handed to a new request at once
    view = driver.step([Row.release_only(3), Row.fresh(3, choice)])
    assert view.results.tolist() == [[-1, ERR_NONE]]
    red = continuation_ids(mistral_32k, "red")
    assert is_allowed(view.masks[1, 0], red[0]) and not is_allowed(view.masks[1, 0], continuation_ids(mistral_32k, '{"')[0])
    driver.finish([[], red])
    view = driver.step([Row(3, 1, FLAG_CONSTRAINED | FLAG_RELEASE)])
    assert view.results.tolist() == [[-1, ERR_NONE], [-1, ERR_NONE]]
    assert list(allowed_tokens(view.masks[0, 0])) == [EOS]


def test_unconstrained_padded_and_unknown_rows(driver, compile_id):
    gid = compile_id("regex", "[0-9]+")
    view = driver.step([Row(0, 2, 0), Row.fresh(1, gid), Row.fresh(2, 0)])  # ids start at 1: 0 names none
    assert view.valid_positions.tolist() == [2, 1, 0]
    assert _ones(view.masks[0]) and _ones(view.masks[2]) and not _ones(view.masks[1, 0])
    assert _ones(view.masks[1, 1:])
    entry = driver.channel.entry(driver.step_no)
    assert _ones(entry.masks[3 * 4:])  # padded rows past the batch
    driver.finish([[5], [], []])
    view = driver.step([Row(1), Row(2)])
    assert view.results.tolist() == [[-1, ERR_NONE], [-1, ERR_NONE], [-1, ERR_UNKNOWN_GRAMMAR]]



def test_draft_walk_stops_exactly_at_the_first_excluded_draft(driver, compile_id, mistral_32k):
    """Rows follow valid documents with 0-3 drafts taken from the document, one of them
    sometimes replaced by a random token; valid_positions must stop exactly at the first
    draft its position's mask excludes, and the verifier's choice is never rejected."""
    rng = np.random.default_rng(7)
    docs_ids = [continuation_ids(mistral_32k, json.dumps(doc, ensure_ascii=False)) + [EOS] for _, doc in DOCS]
    rows = [Row.fresh(r, compile_id("json_schema", schema)) for r, (schema, _) in enumerate(DOCS)]
    pos = [0] * len(DOCS)
    num_cut = 0
    while min(len(ids) - p for ids, p in zip(docs_ids, pos)) > 4:
        for r, row in enumerate(rows):
            row.drafts = docs_ids[r][pos[r]:pos[r] + int(rng.integers(0, 4))]
            if row.drafts and rng.random() < 0.5:
                row.drafts[int(rng.integers(len(row.drafts)))] = int(rng.integers(32768))
            row.num_positions = 1 + len(row.drafts)
        view = driver.step(rows)
        assert not view.results[:, 1].any()
        tokens = []
        for r, row in enumerate(rows):
            valid = int(view.valid_positions[r])
            assert 1 <= valid <= row.num_positions
            for p in range(valid - 1):
                assert is_allowed(view.masks[r, p], row.drafts[p])
            if valid < row.num_positions:
                num_cut += 1
                assert not is_allowed(view.masks[r, valid - 1], row.drafts[valid - 1])
                assert all(_ones(view.masks[r, p]) for p in range(valid, row.num_positions))
            # the verifier keeps the drafts that match the document, then the document's next token
            keep = 0
            while keep < valid - 1 and row.drafts[keep] == docs_ids[r][pos[r] + keep]:
                keep += 1
            tokens.append(docs_ids[r][pos[r]:pos[r] + keep + 1])
            assert is_allowed(view.masks[r, keep], tokens[-1][-1])
            pos[r] += keep + 1
        driver.finish(tokens)
        rows = [Row(r, 1, FLAG_CONSTRAINED, 0) for r in range(len(DOCS))]
    assert num_cut > 0


def test_a_failing_step_fails_its_constrained_rows_and_still_publishes(driver, service, compile_id, monkeypatch):
    gid = compile_id("regex", "[0-9]+")
    driver.step([Row.fresh(0, gid), Row(1, 1, 0)])
    driver.finish([[], [9]])
    backend = service._backend("xgrammar")

    def broken(*args):
        raise RuntimeError("injected")
    monkeypatch.setattr(backend, "batch_fill", broken)
    view = driver.step([Row(0), Row(1, 1, 0)])
    assert view.valid_positions.tolist() == [0, 1] and (view.masks == -1).all()
    assert view.results[:, 1].tolist() == [4, 4]  # ERR_INTERNAL for the previous step's rows
    monkeypatch.undo()
    driver.finish([[], [9]])
    view = driver.step([Row(0)])  # the service goes on; the failed slot lost its matcher
    assert view.results[0, 1] == ERR_NO_MATCHER


def test_rows_of_two_backends_share_a_step(driver, compile_id, mistral_32k):
    """One batch call per backend: an xgrammar row and an llguidance row in the same steps."""
    ids = continuation_ids(mistral_32k, json.dumps(DOCS[0][1], ensure_ascii=False)) + [EOS]
    grammar_ids = [compile_id("json_schema", PERSON, backend="xgrammar"),
                   compile_id("json_schema", PERSON, backend="llguidance")]
    masks, _ = _replay(driver, grammar_ids, [ids, ids])
    for backend_masks in masks:
        assert all(is_allowed(m, t) for m, t in zip(backend_masks, ids))
    assert list(allowed_tokens(masks[1][-1])) == [EOS]


def test_step_phases_add_up_to_the_step_time_and_reach_the_counter(service, compile_id, mistral_32k):
    """Per-phase step time (loop.py `StepPhases`): advance and fill are measured, the three
    phases add up to the loop's step time, and the Prometheus counter gets the same seconds.
    The loop is driven synchronously (run_step), so every step's time is in when it is read."""
    ids = continuation_ids(mistral_32k, json.dumps(DOCS[0][1], ensure_ascii=False)) + [EOS]
    gid = compile_id("json_schema", PERSON)
    phases = ("advance", "fill", "bookkeeping")

    def counter() -> dict[str, float]:
        return {p: REGISTRY.get_sample_value("structgen_grammar_step_phase_seconds_total", {"phase": p}) or 0.0
                for p in phases}
    before = counter()
    with StepChannel.create(Geometry(max_batch=2, max_positions=1, vocab_size=32768)) as chan:
        loop = StepLoop(chan, 16, 1, service._lookup_grammar)
        for n, token in enumerate(ids, start=1):
            e = chan.entry(n)
            e.desc_header[:] = (n, 2)
            e.desc_rows[0] = (0, 1, FLAG_CONSTRAINED | (FLAG_FRESH if n == 1 else 0), gid)
            e.desc_rows[1] = (1, 1, 0, 0)  # unconstrained
            loop.run_step(n)
            assert n == 1 or e.results[:2, 1].tolist() == [ERR_NONE, ERR_NONE]
            assert is_allowed(e.masks[0], token)
            e.out_counts[:2] = 1
            e.out_tokens[:2, 0] = (token, 9)
    after, p = counter(), loop.phases
    assert loop.num_steps == len(ids)
    assert p.advance_ns > 0 and p.fill_ns > 0 and p.bookkeeping_ns > 0
    assert p.advance_ns + p.fill_ns + p.bookkeeping_ns == loop.total_step_ns
    for name, ns in zip(phases, (p.advance_ns, p.fill_ns, p.bookkeeping_ns)):
        assert after[name] - before[name] == pytest.approx(ns / 1e9, rel=1e-6, abs=1e-9)
    recent = loop.recent_step_us()  # the percentiles benchmarks read: ordered, within the steps' times
    assert list(recent) == ["p50", "p90", "p99", "max"]
    assert 0 < recent["p50"] <= recent["p90"] <= recent["p99"] <= recent["max"] <= loop.total_step_ns / 1e3
