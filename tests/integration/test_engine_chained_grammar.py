"""Constrained rows chain like free rows (engine/mixed_steps.py, engine/stream_channel.py): a mixed
step with constrained rows is launched whole, its grammar step in the step's own order, before
the step before it is read. Here on the CPU runner, where that order is the host's: the greedy
tokens, text, finish reasons and errors equal those of steps run one at a time; every document
validates; a stop string, a cancel, a deadline and a grammar completion in the middle of a chain
end only their own request; every page, slot and matcher comes back. The GPU's:
tests/gpu/test_mixed_steps.py."""
from __future__ import annotations

import dataclasses
import json
import time

import jsonschema
import pytest

from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams
from tests.integration.test_engine_generation import SCHEMA, json_grammar
from tests.integration.test_engine_mixed_steps import LONG, PROMPTS, StepLog
from tests.integration.test_engine_support import collect, make_engine, shared_grammar_service, shared_model, wait_settled

MAX_NEW = 60
STOP = '":'  # after the first key of every document: the cut is known


@pytest.fixture(scope="module")
def grammar_address():
    return shared_grammar_service().address


def constrained(engine, rid: str, prompt: str, **sampling) -> GenerationRequest:
    return GenerationRequest(rid, tuple(engine.tokenizer.encode(prompt)),
                             SamplingParams(max_new_tokens=MAX_NEW, **sampling), grammar=json_grammar())


def run(grammar_address, chained: bool):
    """A constrained request decodes; constrained requests with long prompts arrive beside it (their
    prefill chunks share steps with its rows): greedy ones, a seeded one, one with a stop string,
    one cancelled and one past its deadline while they decode beside those chunks, and a free one."""
    engine = make_engine(grammar_address, model=shared_model(), max_batch=8, page_size=4, prefill_chunk_tokens=8,
                         max_prefill_tokens=8, max_draft_tokens=0, pipeline_mixed=chained)
    try:
        log = StepLog(engine)
        lead = engine.submit(constrained(engine, "lead", PROMPTS[0]))
        head = lead.get(timeout=60)
        while not head.token_ids:  # (the guarantee report comes first)
            head = lead.get(timeout=60)
        specs = [constrained(engine, "json", LONG), constrained(engine, "seeded", LONG[::-1], temperature=0.8, seed=7),
                 constrained(engine, "stop", PROMPTS[4], stop_strings=(STOP,)),
                 constrained(engine, "cancel", LONG[5:]), constrained(engine, "deadline", LONG[9:]),
                 GenerationRequest("free", tuple(engine.tokenizer.encode(PROMPTS[2])),
                                   SamplingParams(max_new_tokens=24, ignore_eos=True))]
        streams = {spec.request_id: engine.submit(spec) for spec in specs}
        ended = []

        def end_two_while_chunks_run(batch):  # a cancel and a deadline beside prefill chunks
            decoding = {row.request.request_id: row.request for row in batch.rows if row.is_decode}
            if batch.num_prefill_tokens and {"cancel", "deadline"} <= decoding.keys() and not ended:
                ended.append(True)
                streams["cancel"].cancel()
                request = decoding["deadline"]
                request.spec = dataclasses.replace(request.spec, deadline=time.monotonic())
        log.on_step = end_two_while_chunks_run
        results = {"lead": collect(lead)} | {rid: collect(stream) for rid, stream in streams.items()}
        results["lead"].token_ids = list(head.token_ids) + results["lead"].token_ids
        results["lead"].text = head.text + results["lead"].text
        return results, wait_settled(engine), bool(ended)
    finally:
        engine.stop()


def test_chained_constrained_steps_stream_what_steps_one_at_a_time_stream(grammar_address):
    (serial, serial_stats, _), (chained, stats, ended) = (run(grammar_address, chained) for chained in (False, True))
    assert ended
    # constrained mixed steps chained: launched, grammar step and all, before the step before was read
    assert stats.num_chained_grammar_steps >= 10, stats
    assert serial_stats.num_chained_grammar_steps == 0
    # the seeded draw is keyed by the token's index, which a chained step knows before the token
    # before it is accepted
    for rid in ("lead", "json", "seeded", "stop", "free"):
        a, b = serial[rid], chained[rid]
        assert (a.token_ids, a.text, a.finish_reason, a.error) == (b.token_ids, b.text, b.finish_reason, b.error), rid
    for rid in ("lead", "json", "seeded"):
        assert chained[rid].finish_reason is FinishReason.GRAMMAR_COMPLETE, (rid, chained[rid])
        jsonschema.validate(json.loads(chained[rid].text), SCHEMA)
    assert chained["stop"].finish_reason is FinishReason.STOP_STRING, chained["stop"]
    assert chained["stop"].text == '{"name', chained["stop"].text
    assert chained["cancel"].finish_reason is FinishReason.CANCELLED
    assert chained["deadline"].finish_reason is FinishReason.DEADLINE, chained["deadline"]
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0), stats
