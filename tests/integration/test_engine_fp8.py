"""The engine on CPU with FP8 linear layers (--quantization fp8) and FP8 KV pages
(--kv-cache-dtype fp8): twice the pages in the same budget, greedy and constrained requests
run through them, every constrained output valid."""
from __future__ import annotations

import json

import jsonschema
import pytest

from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams
from generation_service.model.quantization.linear import Fp8Linear
from grammar_contract.spec import GrammarSpec
from tests.integration.test_engine_support import (
    collect, make_engine, shared_grammar_service, shared_model, wait_settled,
)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}
BUDGET = 4 << 20


@pytest.fixture(scope="module")
def engines():
    grammar = shared_grammar_service()
    common = dict(model=shared_model(), dtype="bfloat16", max_batch=4, page_size=8, kv_memory_budget_bytes=BUDGET)
    bf16 = make_engine(grammar.address, **common)
    fp8 = make_engine(grammar.address, quantization="fp8", kv_cache_dtype="fp8", **common)
    yield bf16, fp8
    bf16.stop()
    fp8.stop()


def test_fp8_pages_double_the_cache_in_the_same_budget(engines):
    bf16, fp8 = engines
    assert fp8.stats().num_kv_pages_total == 2 * bf16.stats().num_kv_pages_total
    assert any(isinstance(m, Fp8Linear) for m in fp8.runner.model.modules())


def test_fp8_engine_serves_greedy_and_constrained_requests(engines):
    _, engine = engines
    prompt = tuple(engine.tokenizer.encode("Name a colour and say if it is ok:"))
    free = collect(engine.submit(GenerationRequest("free", prompt, SamplingParams(max_new_tokens=12))))
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False)
    constrained = collect(engine.submit(GenerationRequest("json", prompt, SamplingParams(max_new_tokens=48),
                                                          grammar=grammar)))
    assert free.error is None and free.finish_reason in (FinishReason.MAX_TOKENS, FinishReason.STOP_TOKEN) and free.token_ids
    assert constrained.error is None and constrained.finish_reason is FinishReason.GRAMMAR_COMPLETE
    jsonschema.validate(json.loads(constrained.text), SCHEMA)
    assert wait_settled(engine).num_kv_pages_used == 0
