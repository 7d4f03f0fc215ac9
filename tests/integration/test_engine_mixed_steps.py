"""Mixed steps on CPU: prefill chunks of several requests share steps with decode rows.

A request that arrives while others decode is prefilled in chunks beside their decode rows;
its greedy tokens and theirs equal what each gets alone (prefill, then decode). Cancelling a
request mid-prefill frees its pages, slot and matcher at once; constrained rows decoding beside
prefill chunks stay valid. The same on the GPU's mixed forward: tests/gpu/test_mixed_steps.py."""
from __future__ import annotations

import jsonschema
import pytest

from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams
from tests.integration.test_engine_generation import SCHEMA, json_grammar
from tests.integration.test_engine_support import (
    collect, make_engine, shared_grammar_service, shared_model, wait_settled,
)

LONG = " ".join(f"item {i}: the value is {i * 7 % 13}." for i in range(12))  # ~100 tokens
PROMPTS = ["Hello, my name is", LONG, "1 2 3 4 1 2 3 4", LONG[::-1], "def f(x): return x +"]


class StepLog:
    """Records what each step of the engine's runner computed (the runner is real)."""

    def __init__(self, engine) -> None:
        self.steps: list[list[tuple[str, int, bool]]] = []  # per step: (request id, new tokens, is decode)
        self._run = engine.runner.run
        self.on_step = None
        engine.runner.run = self

    def __call__(self, batch, fed_back=None):
        self.steps.append([(row.request.request_id, len(row.input_ids), row.is_decode) for row in batch.rows])
        if self.on_step is not None:
            self.on_step(batch)
        return self._run(batch, fed_back)

    @property
    def num_mixed(self) -> int:
        """Steps that held a decode row and another request's prefill chunk."""
        return sum(1 for step in self.steps
                   if any(decode for _, _, decode in step) and any(n > 1 for _, n, _ in step))


def greedy(engine, rid: str, prompt: str, new_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(rid, tuple(engine.tokenizer.encode(prompt)),
                             SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))


@pytest.fixture(scope="module")
def grammar_address():
    return shared_grammar_service().address


def small_chunk_engine(grammar_address=None):
    return make_engine(grammar_address, model=shared_model(), max_batch=8, page_size=4,
                       prefill_chunk_tokens=8, max_prefill_tokens=8, max_draft_tokens=0)


def test_staggered_requests_share_steps_and_get_their_tokens_alone():
    alone = {}
    engine = small_chunk_engine()
    try:  # each request alone: its prefill chunks, then its decode steps
        for i, prompt in enumerate(PROMPTS):
            alone[i] = collect(engine.submit(greedy(engine, f"alone{i}", prompt))).token_ids
        engine_mixed = small_chunk_engine()
    finally:
        engine.stop()
    try:
        log = StepLog(engine_mixed)
        streams = {0: engine_mixed.submit(greedy(engine_mixed, "m0", PROMPTS[0], 40))}
        first = streams[0].get(timeout=60)  # m0 decodes now; the rest arrive beside it
        assert first.token_ids and not first.is_final
        for i in range(1, len(PROMPTS)):
            streams[i] = engine_mixed.submit(greedy(engine_mixed, f"m{i}", PROMPTS[i]))
        results = {i: collect(stream) for i, stream in streams.items()}
        results[0].token_ids = list(first.token_ids) + results[0].token_ids
        stats = wait_settled(engine_mixed)
    finally:
        engine_mixed.stop()
    assert log.num_mixed >= 10, log.steps  # LONG's 13 chunks ran beside decode rows
    for i, result in results.items():
        assert result.finish_reason is FinishReason.MAX_TOKENS, result.error
        assert result.token_ids[:len(alone[i])] == alone[i], (i, PROMPTS[i][:20])
    assert (stats.num_kv_pages_used, stats.num_slots_used) == (0, 0)
    assert stats.num_prefill_tokens >= 2 * 90 and stats.num_mixed_steps == len(log.steps)


def test_cancel_mid_prefill_frees_pages_slot_and_matcher(grammar_address):
    engine = small_chunk_engine(grammar_address)
    try:
        log = StepLog(engine)
        free = engine.submit(greedy(engine, "free", PROMPTS[2], 30))
        json_request = GenerationRequest("json", tuple(engine.tokenizer.encode(LONG)),
                                         SamplingParams(max_new_tokens=100), grammar=json_grammar())
        long_free = greedy(engine, "long", LONG)
        streams = {"json": engine.submit(json_request), "long": engine.submit(long_free)}

        def cancel_after_two_chunks(batch):
            chunks = sum(1 for step in log.steps for rid, n, _ in step if rid == "long" and n > 1)
            if chunks == 2:
                streams["long"].cancel()
            json_chunks = sum(1 for step in log.steps for rid, n, _ in step if rid == "json" and n > 1)
            if json_chunks == 3:
                streams["json"].cancel()
        log.on_step = cancel_after_two_chunks
        results = {name: collect(stream) for name, stream in streams.items()}
        rest = collect(free)
        stats = wait_settled(engine)
    finally:
        engine.stop()
    for name, result in results.items():
        assert result.finish_reason is FinishReason.CANCELLED, (name, result)
        assert not result.token_ids, (name, result.token_ids)  # cancelled before its prompt was in
    assert rest.finish_reason is FinishReason.MAX_TOKENS and len(rest.token_ids) == 30
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0), stats


def test_constrained_rows_stay_valid_beside_prefill_chunks(grammar_address):
    import json
    engine = small_chunk_engine(grammar_address)
    try:
        log = StepLog(engine)
        streams = [engine.submit(GenerationRequest(f"json{i}", tuple(engine.tokenizer.encode(p)),
                                                   SamplingParams(max_new_tokens=120), grammar=json_grammar()))
                   for i, p in enumerate(PROMPTS[:2])]
        streams[0].get(timeout=60)  # the guarantee: compiled
        streams += [engine.submit(greedy(engine, f"free{i}", prompt)) for i, prompt in enumerate(PROMPTS[1:])]
        results = [collect(stream) for stream in streams]
        stats = wait_settled(engine)
    finally:
        engine.stop()
    assert log.num_mixed >= 5, log.steps
    for result in results[:2]:
        assert result.finish_reason is FinishReason.GRAMMAR_COMPLETE, (result.error, result.text)
        jsonschema.validate(json.loads(result.text), SCHEMA)
    for result in results[2:]:
        assert result.finish_reason is FinishReason.MAX_TOKENS, result.error
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0), stats
