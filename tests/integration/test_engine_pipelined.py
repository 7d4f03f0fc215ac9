"""Pipelined and chained mixed steps (EngineConfig.pipeline_mixed, engine/mixed_steps.py): step
N+1's forward is launched before step N's text is streamed and, chained, before N's tokens are
read (fed back into N+1's inputs by the runner). On by default under CUDA graphs; here on the
CPU runner, where it changes nothing a user sees: the same tokens, text, stop-string cuts and
finish reasons as steps run one at a time, valid constrained outputs, cancels that end their
streams, and every page, slot and matcher back. The GPU's: tests/gpu/test_mixed_steps.py."""
from __future__ import annotations

import json

import jsonschema
import pytest

from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams
from tests.integration.test_engine_generation import SCHEMA, json_grammar
from tests.integration.test_engine_mixed_steps import LONG, PROMPTS, StepLog
from tests.integration.test_engine_support import collect, make_engine, shared_grammar_service, shared_model, wait_settled


@pytest.fixture(scope="module")
def grammar_address():
    return shared_grammar_service().address


def engine_for(grammar_address, pipelined: bool):
    engine = make_engine(grammar_address, model=shared_model(), max_batch=8, page_size=4,
                         prefill_chunk_tokens=8, max_prefill_tokens=8, max_draft_tokens=0,
                         pipeline_mixed=pipelined)
    assert engine._pipeline_mixed is pipelined
    return engine


def run_staggered(grammar_address, pipelined: bool, stop: str | None = None):
    """One request decodes; then free, stop-string and constrained requests arrive beside it."""
    engine = engine_for(grammar_address, pipelined)
    try:
        log = StepLog(engine)
        first = engine.submit(GenerationRequest("lead", tuple(engine.tokenizer.encode(PROMPTS[0])),
                                                SamplingParams(max_new_tokens=40, ignore_eos=True)))
        head = first.get(timeout=60)
        specs = [GenerationRequest(f"free{i}", tuple(engine.tokenizer.encode(p)),
                                   SamplingParams(max_new_tokens=16, ignore_eos=True))
                 for i, p in enumerate(PROMPTS[1:4])]
        specs.append(GenerationRequest("stop", tuple(engine.tokenizer.encode(PROMPTS[4])), SamplingParams(
            max_new_tokens=24, ignore_eos=True, stop_strings=(stop,) if stop else ())))
        specs.append(GenerationRequest("json", tuple(engine.tokenizer.encode(LONG)),
                                       SamplingParams(max_new_tokens=120), grammar=json_grammar()))
        streams = [engine.submit(spec) for spec in specs]
        results = [collect(first)] + [collect(stream) for stream in streams]
        results[0].token_ids = list(head.token_ids) + results[0].token_ids
        results[0].text = head.text + results[0].text
        log.num_chained = engine.mixed.num_chained
        return results, wait_settled(engine), log
    finally:
        engine.stop()


def test_pipelined_steps_stream_what_serial_steps_stream(grammar_address):
    serial, _, _ = run_staggered(grammar_address, False)
    stop = serial[4].text[6:9]  # a stop string inside the output: both runs must cut it there
    assert len(stop) == 3 and stop.strip(), serial[4].text
    runs = {pipelined: run_staggered(grammar_address, pipelined, stop) for pipelined in (False, True)}
    (serial, _, _), (pipelined, stats, log) = runs[False], runs[True]
    assert log.num_mixed >= 5, log.steps  # prompt chunks beside decode rows, pipelined
    assert log.num_chained >= 5, log.steps  # ... launched before the step before was read
    for a, b in zip(serial, pipelined):
        assert (a.token_ids, a.text, a.finish_reason, a.error) == (b.token_ids, b.text, b.finish_reason, b.error)
    assert pipelined[4].finish_reason is FinishReason.STOP_STRING and stop not in pipelined[4].text
    assert pipelined[5].finish_reason is FinishReason.GRAMMAR_COMPLETE, pipelined[5].error
    jsonschema.validate(json.loads(pipelined[5].text), SCHEMA)
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0), stats


def test_cancel_between_pipelined_steps_ends_the_stream(grammar_address):
    engine = engine_for(grammar_address, True)
    try:
        log = StepLog(engine)
        streams = {name: engine.submit(GenerationRequest(name, tuple(engine.tokenizer.encode(prompt)), sampling,
                                                         grammar=grammar))
                   for name, prompt, sampling, grammar in (
                       ("free", PROMPTS[2], SamplingParams(max_new_tokens=30, ignore_eos=True), None),
                       ("long", LONG, SamplingParams(max_new_tokens=30, ignore_eos=True), None),
                       ("json", LONG[::-1], SamplingParams(max_new_tokens=200), json_grammar()))}

        def cancel_while_decoding(batch):  # their tokens of the step before are still deferred
            decoded = {row.request.request_id for row in batch.rows if row.is_decode}
            if {"long", "json"} <= decoded and not log.cancelled:
                log.cancelled = True
                streams["long"].cancel()
                streams["json"].cancel()
        log.cancelled = False
        log.on_step = cancel_while_decoding
        results = {name: collect(stream) for name, stream in streams.items()}
        stats = wait_settled(engine)
    finally:
        engine.stop()
    assert results["free"].finish_reason is FinishReason.MAX_TOKENS and len(results["free"].token_ids) == 30
    for name in ("long", "json"):
        assert results[name].finish_reason is FinishReason.CANCELLED, (name, results[name])
        # the token accepted before the cancel but not yet streamed comes with the final event
        assert 0 < len(results[name].token_ids) < 30, (name, results[name].token_ids)
        assert results[name].usage.completion_tokens == len(results[name].token_ids), results[name]
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0), stats
