"""The Engine with runner="cuda_graph": greedy tokens equal runner="eager" (up to bf16 near
ties), top-k/top-p inside the captured sampler, constrained JSON valid with grammar_service
in its own process, and the watchdog releasing a graph that waits for a dead service."""
from __future__ import annotations

import json

import pytest

from gpu_helpers import (
    NEW_TOKENS, PROMPTS, SCHEMA, TOKENIZER_DIR, check_greedy_rows, check_settled, engine_config, greedy, run_engine,
)
from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams
from grammar_contract.spec import GrammarSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").is_file(),
                                                  reason="no Tekken tokenizer")]
def test_graph_engine_greedy_equals_eager_and_filters_run_in_graphs(model_spec):
    requests = [greedy(i, p) for i, p in enumerate(PROMPTS)]
    # top-k 1 and a tiny top-p keep only the argmax: sampled rows that must equal greedy,
    # through the `+filters` graph variants (temperature > 0).
    requests += [greedy(10, PROMPTS[0], temperature=1.0, top_k=1, seed=7),
                 greedy(11, PROMPTS[2], temperature=1.0, top_p=1e-6, seed=7)]
    eager_engine, eager, _ = run_engine(engine_config(model_spec, "eager"), requests)
    graph_engine, graph, _ = run_engine(engine_config(model_spec, "auto"), requests)
    runner = graph_engine.runner
    assert type(eager_engine.runner).__name__ == "ModelRunner"
    assert type(runner).__name__ == "CudaGraphRunner"
    assert runner.num_graph_steps >= NEW_TOKENS - 1, (runner.num_graph_steps, runner.num_mixed_steps)
    for r in eager + graph:
        assert r.error is None and r.finish_reason is FinishReason.MAX_TOKENS and len(r.token_ids) == NEW_TOKENS
    prompts = PROMPTS + [PROMPTS[0], PROMPTS[2]]
    num_identical = check_greedy_rows(graph_engine, prompts, eager, graph)
    print(f"graph == eager on {num_identical}/{len(prompts)} requests; graph steps {runner.num_graph_steps},"
          f" mixed steps {runner.num_mixed_steps}")
    # rows 5 and 6 (temperature 1) passed the near-argmax check above only because top-k/top-p
    # cut them to the argmax inside the graph: plain temperature-1 draws over 131k tokens
    # would land far from it. (Not compared with rows 0/2 token by token: a bf16 tie is
    # broken by smallest id when greedy, at random when sampled.)


def test_constrained_json_valid_under_graphs_with_grammar_service_process(model_spec, grammar_service):
    import jsonschema
    from grammar_contract.client import GrammarControlClient
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False)
    requests = [lambda engine, i=i: GenerationRequest(
        f"json{i}", tuple(engine.tokenizer.encode(PROMPTS[i])), SamplingParams(max_new_tokens=200),
        grammar=grammar) for i in range(4)]
    requests += [greedy(20, PROMPTS[4])]  # a free row in the same graph steps
    engine, results, _ = run_engine(engine_config(model_spec, "cuda_graph"), requests,
                                 GrammarControlClient(grammar_service.address))
    for r in results[:4]:
        assert r.error is None, r.error
        assert r.finish_reason is FinishReason.GRAMMAR_COMPLETE, r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
        print("json:", r.text)
    assert results[4].finish_reason is FinishReason.MAX_TOKENS
    stats, gpu = engine.stats(), engine.runner.gpu
    print(f"grammar steps {stats.grammar_steps}, graph steps {engine.runner.num_graph_steps}, "
          f"GPU channel steps up to {gpu.next_channel_step - 1}")
    assert stats.grammar_steps > 5 and engine.runner.num_graph_steps > 5
    assert gpu.next_channel_step > 5  # grammar steps ran inside graphs, not only on the host


def test_watchdog_releases_a_graph_waiting_for_a_dead_grammar_service(model_spec, tmp_path):
    from grammar_contract.client import GrammarControlClient
    from tests.integration.test_engine_grammar_failures import interrupt_mid_stream
    from tests.integration.test_engine_support import start_grammar_service
    service = start_grammar_service(tmp_path)
    engine = None
    try:
        from generation_service.engine.engine import Engine
        engine = Engine(engine_config(model_spec, "cuda_graph", grammar_wait_timeout_s=1.0),
                        GrammarControlClient(service.address))
        engine.start()
        interrupt_mid_stream(engine, service.kill, num_disconnects=1)
        assert engine.runner.channel is None  # graphs over the dead region dropped, free ones recaptured
        free = engine.submit(GenerationRequest("after", tuple(engine.tokenizer.encode("Again")),
                                               SamplingParams(max_new_tokens=8, ignore_eos=True)))
        from tests.integration.test_engine_support import collect
        assert collect(free).finish_reason is FinishReason.MAX_TOKENS
    finally:
        if engine is not None:
            engine.stop()
        service.stop()


def test_overlap_gives_the_serial_tokens_and_overlaps(model_spec, grammar_service):
    """Overlap on the real GPU: the same tokens, text and finish reasons as serial graph
    steps (greedy, seeded sampling, constrained JSON, rows ending at different steps), most
    steps launched before the previous one was read, nothing left behind."""
    import jsonschema
    from grammar_contract.client import GrammarControlClient
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False)
    requests = [greedy(i, p, max_new_tokens=8 + 9 * i) for i, p in enumerate(PROMPTS)]
    requests += [greedy(10, PROMPTS[1], temperature=0.8, seed=3, max_new_tokens=40)]
    requests += [lambda engine, i=i: GenerationRequest(
        f"json{i}", tuple(engine.tokenizer.encode(PROMPTS[i])), SamplingParams(max_new_tokens=200),
        grammar=grammar) for i in range(3)]

    def run(overlap):
        return run_engine(engine_config(model_spec, "cuda_graph", overlap=overlap), requests,
                          GrammarControlClient(grammar_service.address))

    _, serial, _ = run(False)
    engine, overlapped, stats = run(True)
    # NOTE: a row ending mid-chain leaves the next step at the larger bucket, where other
    # rows' GEMMs may round differently: greedy rows may part at a bf16 near tie.
    for a, b in zip(serial, overlapped[:len(PROMPTS)]):
        assert b.error is None and b.finish_reason is FinishReason.MAX_TOKENS and len(b.token_ids) == len(a.token_ids)
    num_identical = check_greedy_rows(engine, PROMPTS, serial, overlapped)
    print(f"overlap == serial on {num_identical}/{len(PROMPTS)} greedy rows")
    for r in overlapped[len(PROMPTS):]:
        assert r.error is None, r.error
    for r in overlapped[-3:]:
        assert r.finish_reason is FinishReason.GRAMMAR_COMPLETE, r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
    runner = engine.runner
    print(f"overlap: {runner.num_chained_steps} of {runner.num_graph_steps} graph steps chained")
    assert runner.num_chained_steps > runner.num_graph_steps // 2
    check_settled(stats)
