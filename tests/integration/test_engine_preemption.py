"""Preemption by recompute: with a KV pool too small for the batch, requests are preempted
and resumed, and every output is the same as with a pool that holds them all."""
from __future__ import annotations

import json

import jsonschema
import pytest

from generation_service.engine.errors import QueueFullError
from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from grammar_contract.spec import GrammarSpec
from tests.integration.test_engine_support import (
    make_engine, run_all, shared_grammar_service, shared_model, wait_settled,
)

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["word", "n"], "additionalProperties": False}
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello, my name is", "1 2 3 4 1 2 3 4",
           "def f(x): return x + 1", "Once upon a time there was", "a b c d e f g a b c"]


@pytest.fixture(scope="module")
def setup():
    service = shared_grammar_service()
    common = dict(model=shared_model(), max_batch=6, page_size=4, max_draft_tokens=3, prefill_chunk_tokens=16)
    large = make_engine(service.address, **common)
    # 24 pages x 4 tokens: about three of the six requests' full contexts at a time.
    tiny = make_engine(service.address, num_pages=25, max_waiting=8, **common)
    yield large, tiny
    large.stop()
    tiny.stop()


def requests(engine):
    out = []
    for i, prompt in enumerate(PROMPTS):
        ids = tuple(engine.tokenizer.encode(prompt))
        grammar = GrammarSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False) if i % 3 == 1 else None
        sampling = SamplingParams(max_new_tokens=50 if grammar else 24, temperature=0.8 if i % 2 else 0.0, seed=i)
        out.append(GenerationRequest(f"r{i}", ids, sampling, grammar=grammar,
                                     speculative=SpeculativeParams(3 if i % 4 == 0 else 0)))
    return out


def test_tiny_pool_preempts_and_gives_the_same_outputs(setup):
    large, tiny = setup
    expected = run_all(large, requests(large))
    finished = []
    tiny.table.finish_listeners.append(finished.append)
    got = run_all(tiny, requests(tiny))
    tiny.table.finish_listeners.remove(finished.append)
    assert tiny.stats().num_preemptions > 0
    # a constrained request resumed with its matcher kept (no replay): still valid, same tokens
    assert any(r.num_preemptions and r.is_constrained for r in finished)
    assert large.stats().num_preemptions == 0
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g.error is None and e.error is None
        assert g.token_ids == e.token_ids, f"request {i}"
        assert g.text == e.text
        if i % 3 == 1:
            assert g.finish_reason is FinishReason.GRAMMAR_COMPLETE
            jsonschema.validate(json.loads(g.text), SCHEMA)
    for engine in (large, tiny):
        stats = wait_settled(engine)
        assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0)


def test_waiting_queue_limit_is_resource_exhausted(setup):
    _, tiny = setup
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)
    streams = []
    with pytest.raises(QueueFullError):
        for i in range(40):  # 6 rows + 8 waiting fit; submitting faster than they finish overflows
            streams.append(tiny.submit(GenerationRequest(f"q{i}", (1, 2, 3, 4), long)))
    assert len(streams) >= 8
    for stream in streams:
        stream.cancel()
    stats = wait_settled(tiny)
    assert (stats.num_kv_pages_used, stats.num_slots_used) == (0, 0)
