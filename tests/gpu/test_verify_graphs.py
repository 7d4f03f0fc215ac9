"""Speculative verify steps as CUDA graphs (EngineConfig.verify_graphs, engine/verify_graphs.py):
greedy tokens equal the eager verify path (up to bf16 near ties) with drafts accepted, sampled
verify rows run, constrained JSON with drafts valid through grammar_service in its own process
(masks, valid_positions and the outputs area inside the graph), nothing left behind."""
from __future__ import annotations

import json

import pytest

from gpu_helpers import (
    PROMPTS, SCHEMA, TOKENIZER_DIR, check_greedy_rows, check_settled, engine_config, greedy, run_engine,
    write_random_checkpoint,
)
from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from grammar_contract.spec import GrammarSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").is_file(),
                                                  reason="no Tekken tokenizer")]
# Prompts whose n-grams recur: the n-gram proposer drafts from the first decode step on.
REPEATING = ["1 2 3 4 1 2 3 4 1 2 3", "a b c d e f g a b c d e f g a b",
             "The quick brown fox. The quick brown fox. The quick", "x = 1\nx = 1\nx = 1\nx ="]
JSON_PROMPT = "{\"name\": \"ab\", \"ok\": true, \"name\": \"ab\", \"ok\": true"
NEW_TOKENS = 40
DRAFTS = SpeculativeParams(num_draft_tokens=4)


def drafting(i, prompt, **sampling):
    sampling.setdefault("max_new_tokens", NEW_TOKENS)
    sampling.setdefault("ignore_eos", True)
    return lambda engine: GenerationRequest(f"s{i}", tuple(engine.tokenizer.encode(prompt)),
                                            SamplingParams(**sampling), speculative=DRAFTS)


@pytest.fixture(scope="module")
def tied_model_spec(tmp_path_factory) -> str:
    """The same 2-layer random Llama with tied embeddings: greedy repeats its input token, so
    the n-gram drafts of the repetition are accepted."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tied"), tied=True)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_verify_graphs_give_the_eager_verify_tokens(model_spec, tied_model_spec, tied):
    spec = tied_model_spec if tied else model_spec
    requests = [drafting(i, p) for i, p in enumerate(REPEATING)]
    requests += [greedy(10, PROMPTS[2], max_new_tokens=NEW_TOKENS)]  # a row without speculation, same steps
    requests += [drafting(11, REPEATING[0], temperature=0.8, seed=3)]  # sampled verify rows
    eager_engine, eager, eager_stats = run_engine(engine_config(spec, "cuda_graph", verify_graphs=False), requests)
    engine, graph, stats = run_engine(engine_config(spec, "cuda_graph", verify_graphs=True), requests)
    runner = engine.runner
    assert eager_engine.runner.num_verify_steps == 0 and eager_engine.runner.num_mixed_steps > 0
    for r in eager + graph:
        assert r.error is None and r.finish_reason is FinishReason.MAX_TOKENS and len(r.token_ids) == NEW_TOKENS
    num_identical = check_greedy_rows(engine, REPEATING + [PROMPTS[2]], eager[:-1], graph[:-1])
    print(f"{'tied' if tied else 'untied'}: verify graphs == eager verify on {num_identical}/{len(REPEATING) + 1}"
          f" rows; verify graph steps {runner.num_verify_steps} of {runner.num_graph_steps} graph steps,"
          f" mixed steps {runner.num_mixed_steps} (eager verify engine: {eager_engine.runner.num_mixed_steps});"
          f" drafts accepted {stats.draft_accepted}/{stats.draft_proposed}"
          f" (eager verify: {eager_stats.draft_accepted}/{eager_stats.draft_proposed})")
    assert runner.num_verify_steps > 0 and runner.verify.num_steps == runner.num_verify_steps
    assert stats.draft_proposed > 0
    if tied:  # the repetition is drafted and accepted
        assert stats.draft_accepted > 0 and eager_stats.draft_accepted > 0
    check_settled(stats)
    check_settled(eager_stats)


@pytest.mark.parametrize("proposer", ["ngram", "grammar"])
def test_constrained_json_with_drafts_in_verify_graphs(model_spec, grammar_service, proposer):
    """proposer "grammar": forced runs come with the masks of graphed steps too (wait_gpu)."""
    import jsonschema
    from grammar_contract.client import GrammarControlClient
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False)
    speculative = SpeculativeParams(num_draft_tokens=4, proposer=proposer)
    requests = [lambda engine, i=i: GenerationRequest(
        f"json{i}", tuple(engine.tokenizer.encode(JSON_PROMPT + " " * i)), SamplingParams(max_new_tokens=200),
        grammar=grammar, speculative=speculative) for i in range(3)]
    # a free drafting row long enough to share grammar steps with the constrained rows
    requests += [drafting(20, REPEATING[0], max_new_tokens=200)]
    engine, results, stats = run_engine(engine_config(model_spec, "cuda_graph", verify_graphs=True), requests,
                                        GrammarControlClient(grammar_service.address))
    for r in results[:3]:
        assert r.error is None, r.error
        assert r.finish_reason is FinishReason.GRAMMAR_COMPLETE, r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
        print("json:", r.text, f"drafts {r.usage.draft_tokens_accepted}/{r.usage.draft_tokens_proposed}")
    assert results[3].error is None and results[3].finish_reason is FinishReason.MAX_TOKENS
    verify = engine.runner.verify
    print(f"verify graph steps {verify.num_steps} ({verify.num_channel_steps} grammar steps), grammar steps"
          f" {stats.grammar_steps}, drafts accepted {stats.draft_accepted}/{stats.draft_proposed}")
    assert verify.num_channel_steps > 0  # masks, valid_positions and outputs inside the verify graph
    assert sum(r.usage.draft_tokens_proposed for r in results[:3]) > 0
    check_settled(stats)
