"""The self-speculative proposer end to end on CPU (eager runner): drafts from the model's own
draft layers are verified by the full model, and greedy output is token for token the output
without speculation, free and under a grammar; on the real default model drafts are accepted."""
from __future__ import annotations

import dataclasses
import json

import pytest

from generation_service.engine.errors import InvalidRequestError
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from generation_service.model.layer_skip import DEFAULT_TEXT, LayerSkipChoice, calibrate
from grammar_contract.spec import GrammarSpec
from tests.integration.test_engine_support import (
    make_engine, run_all, shared_grammar_service, shared_model, wait_settled,
)

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "Hello, my name is",
           "1 2 3 4 1 2 3 4 1 2 3", "def f(x): return x + 1\ndef g(x): return f(x) +", "Once upon a time"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


def request(engine, rid, prompt, *, drafts=0, grammar=None, max_new_tokens=24):
    return GenerationRequest(rid, tuple(engine.tokenizer.encode(prompt)), SamplingParams(max_new_tokens=max_new_tokens),
                             grammar=grammar, speculative=SpeculativeParams(drafts, "self"))


def check_identical(engine, prompts, **options):
    plain = run_all(engine, [request(engine, f"p{i}-{id(prompts)}", p, **options) for i, p in enumerate(prompts)])
    drafted = run_all(engine, [request(engine, f"s{i}-{id(prompts)}", p, drafts=4, **options)
                               for i, p in enumerate(prompts)])
    for p, s in zip(plain, drafted):
        assert p.error is None and s.error is None, (p.error, s.error)
        assert s.token_ids == p.token_ids and s.text == p.text
    return drafted


@pytest.fixture(scope="module")
def random_engine():
    engine = make_engine(shared_grammar_service().address, model=shared_model(), max_batch=8, max_draft_tokens=4,
                         page_size=8)
    yield engine
    engine.stop()


def test_an_uncalibrated_model_is_refused_with_the_command_to_run(random_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("STRUCTGEN_CACHE", str(tmp_path))
    with pytest.raises(InvalidRequestError, match="structgen calibrate-self-spec --model random:"):
        random_engine.submit(request(random_engine, "uncalibrated", "hi", drafts=2))


def test_random_weights_roll_back_and_keep_greedy_output(random_engine):
    random_engine.proposers["self"].use(LayerSkipChoice("random", (1,), 0.0, 4, 1.0, (1, 0), (0.0,), 0, "", 0.0))
    before = wait_settled(random_engine)
    for batch_size in (1, 5):
        drafted = check_identical(random_engine, PROMPTS[:batch_size])
        assert sum(r.usage.draft_tokens_proposed for r in drafted) > 0
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False)
    constrained = check_identical(random_engine, PROMPTS[:3], grammar=grammar, max_new_tokens=40)
    assert all(json.loads(r.text)["ok"] in (True, False) for r in constrained)
    after = wait_settled(random_engine)
    assert after.draft_proposed > before.draft_proposed
    assert after.num_kv_pages_used == 0 and after.num_slots_used == 0


@pytest.fixture(scope="module")
def default_engine():
    engine = make_engine(None, model="default", max_batch=4, max_draft_tokens=4, page_size=16)
    yield engine
    engine.stop()


def test_the_default_model_calibrates_deterministically_and_accepts_drafts(default_engine):
    model = default_engine.proposers["self"].model
    texts = [default_engine.tokenizer.encode(part)[:48] for part in DEFAULT_TEXT.read_text().split("\n===\n")]
    first = calibrate(model, texts, "default", max_skip=3)
    second = calibrate(model, texts, "default", max_skip=3)
    assert dataclasses.replace(second, seconds=first.seconds) == first  # the same set, the same measures
    default_engine.proposers["self"].use(first)
    drafted = check_identical(default_engine, PROMPTS[:3], max_new_tokens=32)
    proposed = sum(r.usage.draft_tokens_proposed for r in drafted)
    accepted = sum(r.usage.draft_tokens_accepted for r in drafted)
    assert 0 < accepted < proposed, (accepted, proposed)  # a trained model's draft layers agree often

