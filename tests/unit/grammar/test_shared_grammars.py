"""Grammars shared between grammar_service processes (grammar_service/shared_grammars.py): a
grammar requests reuse in one is compiled by another before any request asks it there, one used
once is not, nor one of another tokenizer, and a process with an open channel compiles none."""
from __future__ import annotations

import json
import time

import pytest

from grammar_contract.spec import GrammarSpec, ReasoningSpan
from grammar_service import shared_grammars
from grammar_service.compiler import spec_key
from grammar_service.config import GrammarServiceConfig
from grammar_service.service import GrammarService
from grammar_service.shared_grammars import SharedGrammars
from step_channel import Geometry, StepChannel

VOCAB = 32768
REUSED = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"reused": {"type": "boolean"}}}))
ONCE = GrammarSpec("regex", "used-once-[0-9]{3}")


def _wait(condition, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def pair(tmp_path, mistral_32k_dir):
    config = GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB, num_compile_threads=1,
                                  shared_grammars_dir=str(tmp_path / "grammars"))
    serving, standby = GrammarService(config), GrammarService(config)
    yield serving, standby
    serving.close()
    standby.close()


def test_a_reused_grammar_is_compiled_by_the_other_process_ahead_of_its_requests(pair, mistral_32k_dir,
                                                                                 mistral_32k_fingerprint):
    serving, standby = pair
    chan = StepChannel.create(Geometry(max_batch=2, max_positions=1, vocab_size=VOCAB))
    serving.open_channel(chan.name, chan.geometry, max_slots=2, first_step=1, tokenizer_dir=mistral_32k_dir,
                         tokenizer_fingerprint=mistral_32k_fingerprint)
    try:
        for spec in (REUSED, REUSED, dataclasses_strict(REUSED), ONCE):
            serving.compile(spec).result(60)
        reused, once = spec_key(REUSED, "auto"), spec_key(ONCE, "auto")
        assert _wait(lambda: standby.stats()["num_cached_grammars"] == 1), "the standby did not compile it"
        assert standby._compiler.is_cached(reused) and not standby._compiler.is_cached(once)
        outcome = standby.compile(REUSED).result(10)
        assert outcome.cache_hit and outcome.entry.grammar_id != serving.compile(REUSED).result(10).entry.grammar_id
        assert serving.stats()["num_compiles"] == 2  # with a channel open it compiled nothing it was not asked
    finally:
        serving.close_channel(chan.name)
        chan.close()


def dataclasses_strict(spec: GrammarSpec) -> GrammarSpec:
    import dataclasses
    return dataclasses.replace(spec, strict=True)  # the same grammar: strict is each caller's check


def test_records_round_trip_skip_other_tokenizers_and_stay_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_grammars, "MAX_RECORDS", 3)
    mine, theirs = SharedGrammars(tmp_path, "fp-a"), SharedGrammars(tmp_path, "fp-b")
    spec = GrammarSpec("choice", choices=("x", "y"), reasoning=ReasoningSpan(max_tokens=7), strict=True)
    mine.record("k1", spec)
    theirs.record("k2", REUSED)
    assert mine.recorded(lambda key: False) == [("k1", GrammarSpec("choice", choices=("x", "y"),
                                                                  reasoning=ReasoningSpan(max_tokens=7)))]
    for key in ("k3", "k4", "k5"):
        mine.record(key, ONCE)
    assert len(list(tmp_path.glob("*.json"))) == 3
    assert [key for key, _ in mine.recorded(lambda key: False)] == ["k5", "k4", "k3"]  # newest first
