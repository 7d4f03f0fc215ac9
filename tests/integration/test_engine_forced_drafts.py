"""The grammar proposer end to end on CPU (engine + a real grammar_service): tokens the grammar
forces are drafted and verified like n-gram drafts, and greedy output is token for token the
output without speculation."""
from __future__ import annotations

import json

import jsonschema
import pytest

from forced_structure import SHIPMENT as SCHEMA
from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from generation_service.engine.speculative import GrammarProposer
from grammar_contract.spec import GrammarSpec
from tests.integration.test_engine_support import (
    collect, make_engine, run_all, shared_grammar_service, shared_model, wait_settled,
)

PROMPTS = ["Shipment record as JSON:", "{\"customer_account_identifier\": \"ACC-0000000002\", ", "Hello"]


@pytest.fixture(scope="module")
def engine():
    engine = make_engine(shared_grammar_service().address, model=shared_model(), max_batch=8,
                         max_draft_tokens=4, page_size=8)
    yield engine
    engine.stop()


def request(engine, rid, prompt, *, backend="xgrammar", drafts=0, proposer="grammar", schema=SCHEMA, **sampling):
    sampling.setdefault("max_new_tokens", 400)
    grammar = GrammarSpec("json_schema", json.dumps(schema), any_whitespace=False, backend=backend)
    return GenerationRequest(rid, tuple(engine.tokenizer.encode(prompt)), SamplingParams(**sampling),
                             grammar=grammar, speculative=SpeculativeParams(drafts, proposer))


def check(result, schema=SCHEMA):
    assert result.error is None, result.error
    assert result.finish_reason is FinishReason.GRAMMAR_COMPLETE, result.text
    jsonschema.validate(json.loads(result.text), schema)


@pytest.fixture
def forced_proposals(monkeypatch):
    """(request, number of its tokens, drafts) of every proposal that came from a forced run."""
    proposals = []
    propose = GrammarProposer.propose

    def spy(self, request, k):
        drafts = propose(self, request, k)
        run = request.forced_run
        if drafts and run is not None and run.after(request.token_ids)[:len(drafts)] == drafts:
            proposals.append((request.request_id, request.num_tokens, drafts))
        return drafts

    monkeypatch.setattr(GrammarProposer, "propose", spy)
    return proposals


def num_forced_accepted(proposals, engine, requests, results) -> int:
    """Forced drafts that are the tokens the request then has at their positions: greedy
    verification accepted exactly those."""
    tokens = {r.request_id: list(r.prompt_ids) + res.token_ids for r, res in zip(requests, results)}
    accepted = 0
    for request_id, start, drafts in proposals:
        have = tokens[request_id][start:start + len(drafts)]
        accepted += next((i for i, (a, b) in enumerate(zip(drafts, have)) if a != b), len(have))
    return accepted


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_greedy_with_forced_drafts_is_token_identical_and_drafts_are_accepted(engine, backend, forced_proposals):
    before = wait_settled(engine)
    plain = run_all(engine, [request(engine, f"fp-{backend}-{i}", p, backend=backend) for i, p in enumerate(PROMPTS)])
    requests = [request(engine, f"fs-{backend}-{i}", p, backend=backend, drafts=4) for i, p in enumerate(PROMPTS)]
    forced = run_all(engine, requests)
    for p, f in zip(plain, forced):
        check(p)
        assert f.token_ids == p.token_ids and f.text == p.text
    # Random weights often spell forced text with other tokens than the backend's, so only
    # some forced drafts pass; every request gets some, and the verifier took some of them.
    assert {request_id for request_id, _, _ in forced_proposals} == {r.request_id for r in requests}
    assert num_forced_accepted(forced_proposals, engine, requests, forced) > 0
    assert sum(r.usage.draft_tokens_accepted for r in forced) > 0
    after = wait_settled(engine)
    assert after.num_grammar_matchers == before.num_grammar_matchers == 0


def test_forced_drafts_combine_with_ngram_drafts_where_the_grammar_forces_nothing(engine):
    """Free strings: the grammar forces the keys, and the n-gram proposer drafts in the
    values (from the prompt); output still identical to decoding without speculation."""
    schema = {"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 24},
                                               "last_name": {"type": "string", "maxLength": 24}},
              "required": ["first_name", "last_name"], "additionalProperties": False}
    prompt = "{\"first_name\": \"ab ab ab ab\", \"last_name\": \"ab ab ab ab\"} " * 2
    plain = collect(engine.submit(request(engine, "cn-plain", prompt, schema=schema)))
    forced = collect(engine.submit(request(engine, "cn-forced", prompt, schema=schema, drafts=4)))
    check(plain, schema)
    assert forced.token_ids == plain.token_ids
    assert forced.usage.draft_tokens_accepted > 0


def test_seeded_sampling_with_forced_drafts_still_validates(engine):
    """Rejection sampling of forced drafts: the sampled document stays valid and reproducible."""
    runs = [collect(engine.submit(request(engine, f"fseed{i}", PROMPTS[0], drafts=4, temperature=0.9, seed=5)))
            for i in range(2)]
    for result in runs:
        check(result)
    assert runs[0].token_ids == runs[1].token_ids
