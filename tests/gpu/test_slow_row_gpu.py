"""A slow grammar on the CUDA-graph runner (issue 19 point 6, engine/late_mask.py).

grammar_service here makes every fill of a grammar marked MARKER take SLOW_MS longer. Decode
graphs wait for every row's mask, so a request found late once sits out of steps while its next
fill runs and joins a host step when due: the other requests run decode graphs meanwhile, at far
better than the slow row's pace, every document is valid, and nothing is left behind. (That a
late row's output is the one it gives on time is shown on the CPU, where runs are bit-exact:
tests/integration/test_api_slow_grammar.py.)"""
from __future__ import annotations

import json
import time

import pytest

from gpu_helpers import PROMPTS, SCHEMA, TOKENIZER_DIR, check_settled, engine_config
from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams
from grammar_contract.spec import GrammarSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").is_file(),
                                                  reason="no Tekken tokenizer")]
MARKER = "gpu-slow-row-test"
SLOW_MS = 40
SLOW = {"type": "object", "description": MARKER,
        "properties": {"motto": {"type": "string", "minLength": 12, "maxLength": 24}},
        "required": ["motto"], "additionalProperties": False}


@pytest.fixture(scope="module")
def slow_grammar_service(tmp_path_factory):
    """`python -m grammar_service` whose fills of MARKER grammars take SLOW_MS longer."""
    from tests.integration.test_engine_support import start_grammar_service
    env = pytest.MonkeyPatch()
    env.setenv("STRUCTGEN_GRAMMAR_SLOW_FILL_MS", str(SLOW_MS))
    env.setenv("STRUCTGEN_GRAMMAR_SLOW_FILL_MARKER", MARKER)
    try:
        service = start_grammar_service(tmp_path_factory.mktemp("slow-grammar"))
    finally:
        env.undo()
    yield service
    service.stop()


def _request(engine, request_id: str, prompt: str, schema: dict) -> GenerationRequest:
    return GenerationRequest(request_id, tuple(engine.tokenizer.encode(prompt)), SamplingParams(max_new_tokens=64),
                             grammar=GrammarSpec("json_schema", json.dumps(schema), any_whitespace=False))


# Passed on the H200 first at 498938c (gpu-tests-h200-slow-row-median.log): before, a first forward
# that compiled kernels kept GrammarLink's mean forward time long, and no fill was slow beside it.
def test_a_slow_grammar_sits_out_while_the_other_requests_run_decode_graphs(model_spec, slow_grammar_service):
    import jsonschema
    from generation_service.engine.engine import Engine
    from grammar_contract.client import GrammarControlClient
    from tests.integration.test_engine_support import collect, run_all, wait_settled
    engine = Engine(engine_config(model_spec, "cuda_graph"), GrammarControlClient(slow_grammar_service.address))
    engine.start()
    try:
        # a timed host step first: until one is, no row is late (GrammarLink.forward_us)
        run_all(engine, [_request(engine, "warm", PROMPTS[1], SCHEMA)])
        warm_forward_us = engine.link.forward_us  # a first forward that compiled kernels must not count long
        # all at once: the others prefill in one host step; the slow row's first fill comes there
        # or, if its grammar compiles later, in a decode graph; every later step is a decode graph
        # until one held by its fill asks for host steps (HeldGraphs), where it is late
        slow_stream = engine.submit(_request(engine, "slow", PROMPTS[0], SLOW))
        graph_steps, started = engine.runner.num_graph_steps, time.monotonic()
        ordinary = run_all(engine, [_request(engine, f"o{i}", PROMPTS[1 + i % 4], SCHEMA) for i in range(6)])
        ordinary_s = time.monotonic() - started
        graph_steps_beside = engine.runner.num_graph_steps - graph_steps
        slow = collect(slow_stream)
        slow_s = time.monotonic() - started
        stats = wait_settled(engine)
        num_late_rows, num_probes, forward_us = engine.table.num_late_rows, engine.held.num_probes, engine.link.forward_us
        num_fast_again = engine.table.num_fast_again
    finally:
        engine.stop()
    longest = max(len(result.token_ids) for result in ordinary)
    print(f"ordinary: {longest} tokens in {ordinary_s:.2f} s; slow row: {len(slow.token_ids)} tokens in "
          f"{slow_s:.2f} s; graph steps beside it {graph_steps_beside}; late rows {num_late_rows}; "
          f"host steps asked for by held graphs {num_probes}; late rows fast again {num_fast_again}; host forward {warm_forward_us} us after the warm-up, {forward_us} us at the end")
    assert slow.error is None and slow.finish_reason is FinishReason.GRAMMAR_COMPLETE, (slow.error, slow.text)
    jsonschema.validate(json.loads(slow.text), SLOW)
    for result in ordinary:
        assert result.error is None and result.finish_reason is FinishReason.GRAMMAR_COMPLETE, (result.error, result.text)
        jsonschema.validate(json.loads(result.text), SCHEMA)
    assert num_late_rows >= 1, "the slow row was never late: nothing here tested sitting out"
    # the others decoded in graphs, not at the slow row's pace (SLOW_MS a token in lockstep)
    assert graph_steps_beside >= 10, (graph_steps_beside, num_late_rows)
    assert ordinary_s < longest * SLOW_MS / 1e3 / 2, (ordinary_s, longest)
    check_settled(stats)
