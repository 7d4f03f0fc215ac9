"""Engine end to end on CPU with a real grammar_service process: speculation, mixed
constrained/free batches, seeded sampling, stop conditions, cancellation, submit errors."""
from __future__ import annotations

import json

import jsonschema
import pytest

from generation_service.engine.errors import (
    InvalidRequestError, LimitExceededError,
)
from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from grammar_contract.spec import GrammarSpec
from tests.integration.test_engine_support import (
    collect, make_engine, run_all, shared_grammar_service, shared_model, wait_settled,
)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1 2 3 4 1 2 3 4 1 2 3",
    "Hello, my name is",
    "a b c d e f g a b c d e f g a b",
    "def f(x): return x + 1\ndef g(x): return f(x) +",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "color"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ("alpha", "beta", "gamma delta")


@pytest.fixture(scope="module")
def grammar_service():
    return shared_grammar_service()


@pytest.fixture(scope="module")
def engine(grammar_service):
    engine = make_engine(grammar_service.address, model=shared_model(), max_batch=8, max_draft_tokens=4,
                         page_size=8)
    yield engine
    engine.stop()


def ids(engine, text):
    return tuple(engine.tokenizer.encode(text))


def request(engine, rid, prompt, *, drafts=0, grammar=None, **sampling):
    sampling.setdefault("max_new_tokens", 24)
    return GenerationRequest(rid, ids(engine, prompt), SamplingParams(**sampling), grammar=grammar,
                             speculative=SpeculativeParams(drafts))


def json_grammar():
    return GrammarSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False)


def check_constrained(kind, result):
    assert result.error is None, result.error
    assert result.finish_reason is FinishReason.GRAMMAR_COMPLETE, (kind, result.text)
    assert result.guarantee is not None and result.guarantee.backend and result.is_guarantee_first
    if kind == "json":
        jsonschema.validate(json.loads(result.text), SCHEMA)
    elif kind == "regex":
        import re
        assert re.fullmatch(REGEX, result.text), result.text
    else:
        assert result.text in CHOICES


def test_greedy_with_speculation_is_token_identical(engine):
    before = wait_settled(engine)
    for batch_size in (1, 5):
        prompts = PROMPTS[:batch_size]
        plain = run_all(engine, [request(engine, f"p{batch_size}-{i}", p) for i, p in enumerate(prompts)])
        spec = run_all(engine, [request(engine, f"s{batch_size}-{i}", p, drafts=4) for i, p in enumerate(prompts)])
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        assert [r.text for r in spec] == [r.text for r in plain]
    after = engine.stats()
    proposed, accepted = after.draft_proposed - before.draft_proposed, after.draft_accepted - before.draft_accepted
    assert 0 < accepted < proposed  # both outcomes of verification happened
    assert after.grammar_steps == before.grammar_steps  # free-only steps never touch the channel


def test_greedy_with_speculation_is_identical_under_a_grammar(engine):
    grammars = [json_grammar(), GrammarSpec("regex", REGEX), GrammarSpec("choice", choices=CHOICES)]
    prompt = "{\"name\": \"ab\", \"ok\": true, \"name\": \"ab\", \"ok\": true"
    plain = run_all(engine, [request(engine, f"gp{i}", prompt, grammar=g, max_new_tokens=60)
                             for i, g in enumerate(grammars)])
    spec = run_all(engine, [request(engine, f"gs{i}", prompt, grammar=g, max_new_tokens=60, drafts=4)
                            for i, g in enumerate(grammars)])
    for kind, p, s in zip(("json", "regex", "choice"), plain, spec):
        check_constrained(kind, p)
        assert s.token_ids == p.token_ids and s.text == p.text
    assert sum(r.usage.draft_tokens_proposed for r in spec) > 0


def test_mixed_batch_constrained_outputs_validate_and_free_ones_are_unaffected(engine):
    alone = [collect(engine.submit(request(engine, f"alone{i}", p))) for i, p in enumerate(PROMPTS[:3])]
    mixed = [request(engine, "free0", PROMPTS[0]),
             request(engine, "json", PROMPTS[2], grammar=json_grammar(), max_new_tokens=80),
             request(engine, "free1", PROMPTS[1]),
             request(engine, "regex", PROMPTS[3], grammar=GrammarSpec("regex", REGEX), max_new_tokens=40),
             request(engine, "choice", PROMPTS[4], grammar=GrammarSpec("choice", choices=CHOICES)),
             request(engine, "free2", PROMPTS[2]),
             request(engine, "json-sampled", PROMPTS[0], grammar=json_grammar(), max_new_tokens=80,
                     temperature=1.0, seed=5)]
    results = dict(zip([r.request_id for r in mixed], run_all(engine, mixed)))
    for name, kind in (("json", "json"), ("regex", "regex"), ("choice", "choice"), ("json-sampled", "json")):
        check_constrained(kind, results[name])
    for i in range(3):
        assert results[f"free{i}"].token_ids == alone[i].token_ids
        assert results[f"free{i}"].guarantee is None
    stats = wait_settled(engine)
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0)


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    def seeded(rid, seed, drafts=0):
        return request(engine, rid, PROMPTS[0], temperature=0.9, top_p=0.95, top_k=50, seed=seed, drafts=drafts)

    alone = collect(engine.submit(seeded("seed-alone", 11)))
    batch = run_all(engine, [request(engine, "n1", PROMPTS[1], temperature=1.0), seeded("seed-batch", 11),
                             seeded("seed-other", 12), request(engine, "n2", PROMPTS[2])])
    assert batch[1].token_ids == alone.token_ids
    assert batch[2].token_ids != alone.token_ids
    spec_a = collect(engine.submit(seeded("seed-spec-a", 11, drafts=3)))
    spec_b = run_all(engine, [seeded("seed-spec-b", 11, drafts=3), request(engine, "n3", PROMPTS[3])])[0]
    assert spec_a.token_ids == spec_b.token_ids


def test_stop_strings_and_max_tokens_end_with_their_reason(engine):
    full = collect(engine.submit(request(engine, "full", PROMPTS[2], max_new_tokens=24)))
    assert full.finish_reason is FinishReason.MAX_TOKENS and full.usage.completion_tokens == 24
    assert len(full.token_ids) == 24
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    assert stop.strip(), full.text
    cut = collect(engine.submit(request(engine, "cut", PROMPTS[2], max_new_tokens=24, stop_strings=(stop,))))
    assert cut.finish_reason is FinishReason.STOP_STRING
    assert cut.text == full.text[:full.text.index(stop)]
    assert stop not in cut.text
    first = full.token_ids[3]
    by_id = collect(engine.submit(request(engine, "by-id", PROMPTS[2], stop_token_ids=(first,))))
    assert by_id.finish_reason is FinishReason.STOP_TOKEN and by_id.token_ids == full.token_ids[:4]


def test_cancel_frees_pages_slots_and_matchers(engine, grammar_service):
    from grammar_contract.client import GrammarControlClient

    wait_settled(engine)  # earlier tests' matchers are released
    streams = [engine.submit(request(engine, "c-free", PROMPTS[0], max_new_tokens=400, ignore_eos=True)),
               engine.submit(request(engine, "c-json", PROMPTS[1], grammar=GrammarSpec("regex", "[a-z]{500}"),
                                     max_new_tokens=400))]
    for stream in streams:
        while not stream.get(timeout=60).token_ids:
            pass
    assert engine.stats().num_grammar_matchers == 1
    for stream in streams:
        stream.cancel()
    for stream in streams:
        assert collect(stream).finish_reason is FinishReason.CANCELLED
    stats = wait_settled(engine)
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0)
    client = GrammarControlClient(grammar_service.address)
    assert client.stats()["num_bound_matchers"] == 0
    client.close()


def test_submit_refuses_bad_requests_synchronously(engine):
    with pytest.raises(LimitExceededError):
        engine.submit(request(engine, "too-long", "hi", max_new_tokens=engine.config.max_new_tokens_limit + 1))
    with pytest.raises(InvalidRequestError):
        engine.submit(GenerationRequest("bad-id", (1, engine.model_config.vocab_size)))
    with pytest.raises(InvalidRequestError):
        engine.submit(request(engine, "bad-proposer", "hi", drafts=2).__class__(
            "bad-proposer", (1, 2), speculative=SpeculativeParams(2, proposer="oracle")))
    bad_grammar = collect(engine.submit(request(engine, "bad-grammar", "hi", grammar=GrammarSpec("regex", "(("))))
    assert bad_grammar.finish_reason is FinishReason.ERROR and bad_grammar.error.status == "INVALID_ARGUMENT"
    assert bad_grammar.token_ids == []


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine):
    real_run = engine.runner.run
    calls = []

    def run_once_broken(batch, fed_back=None):  # the first forward that holds both requests fails
        if not calls and {row.request.request_id for row in batch.rows} >= {"broken-json", "broken-free"}:
            calls.append(1)
            raise RuntimeError("injected forward failure")
        return real_run(batch, fed_back)

    engine.runner.run = run_once_broken
    try:
        broken = run_all(engine, [request(engine, "broken-json", PROMPTS[0], grammar=json_grammar()),
                                  request(engine, "broken-free", PROMPTS[1])])
    finally:
        engine.runner.run = real_run
    assert calls and all(r.finish_reason is FinishReason.ERROR and r.error.status == "INTERNAL" for r in broken)
    after = run_all(engine, [request(engine, "after-json", PROMPTS[0], grammar=json_grammar(), max_new_tokens=80),
                             request(engine, "after-free", PROMPTS[1])])
    check_constrained("json", after[0])
    assert after[1].finish_reason is FinishReason.MAX_TOKENS
    stats = wait_settled(engine)
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0)


def test_logprobs_are_streamed_per_token(engine):
    result = collect(engine.submit(request(engine, "logprobs", PROMPTS[0], max_new_tokens=6, num_logprobs=3,
                                           drafts=2)))
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    for lp in result.logprobs:  # greedy: the chosen token is the most likely one
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id and lp.logprob <= 0


PROCESSING = [dict(presence_penalty=0.8), dict(frequency_penalty=0.5, repetition_penalty=1.3),
              dict(repetition_penalty=0.8, min_tokens=6, logit_bias=((5, 3.0),))]


def test_greedy_with_speculation_is_identical_under_penalties_and_the_eos_hold(engine):
    """Verify positions see the drafts before them as generated (logit_processing.py), so
    speculation keeps penalized greedy output token for token; neutral rows beside them are
    unaffected."""
    rows = [(f"{i}-{j}", prompt, options) for i, options in enumerate(PROCESSING)
            for j, prompt in enumerate(PROMPTS[:2])]
    plain = run_all(engine, [request(engine, f"pp{rid}", p, **o) for rid, p, o in rows])
    neutral_alone = collect(engine.submit(request(engine, "neutral-alone", PROMPTS[3])))
    spec = run_all(engine, [request(engine, f"ps{rid}", p, drafts=4, **o) for rid, p, o in rows]
                   + [request(engine, "neutral-beside", PROMPTS[3])])
    assert [r.token_ids for r in spec[:-1]] == [r.token_ids for r in plain]
    assert spec[-1].token_ids == neutral_alone.token_ids
    assert sum(r.usage.draft_tokens_accepted for r in spec) > 0
    unpenalized = run_all(engine, [request(engine, f"pu{rid}", p) for rid, p, _ in rows])
    assert [r.token_ids for r in plain] != [r.token_ids for r in unpenalized]


@pytest.mark.parametrize("drafts", [0, 4])
def test_min_tokens_holds_eos_on_every_step_kind(engine, drafts):
    """EOS forced by its bias: it comes exactly at index min_tokens, whether the earlier
    tokens came from the step right after prefill, decode steps or verified drafts."""
    eos = engine.eos_token_ids[0]
    bias = ((eos, 100.0),)
    for min_tokens in (1, 7):
        held = collect(engine.submit(request(engine, f"hold{drafts}-{min_tokens}", PROMPTS[1], drafts=drafts,
                                             logit_bias=bias, min_tokens=min_tokens)))
        assert held.finish_reason is FinishReason.STOP_TOKEN
        assert held.token_ids[-1] == eos and len(held.token_ids) == min_tokens + 1
        assert not set(engine.eos_token_ids) & set(held.token_ids[:-1])


def test_min_tokens_never_breaks_a_constraint(engine):
    """Once the grammar allows only EOS the hold yields: the output is complete and valid."""
    eos = engine.eos_token_ids[0]
    result = collect(engine.submit(request(engine, "hold-json", PROMPTS[2], grammar=json_grammar(),
                                           max_new_tokens=80, min_tokens=80, logit_bias=((eos, 100.0),))))
    check_constrained("json", result)
