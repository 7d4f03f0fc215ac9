"""The compiled-grammar store: reload across restarts, only when it beats compiling."""
from __future__ import annotations

import json
import os
import stat
import time

import numpy as np

from grammar_contract.spec import GrammarSpec
from grammar_service.persist import CompiledGrammarStore, codec_for, xgrammar_codec

FP = "ab" * 32


def _codec(calls):
    def serialize(obj):
        calls.append("serialize")
        return json.dumps(obj)

    def deserialize(text):
        calls.append("deserialize")
        return json.loads(text)
    return serialize, deserialize


def _slow_compile(value, seconds=0.02):
    def compile():
        time.sleep(seconds)
        return value
    return compile


def test_a_slow_grammar_is_reloaded_by_a_new_store_after_a_restart(tmp_path):
    calls = []
    store = CompiledGrammarStore(tmp_path, "fake", "1.0", FP, min_compile_ms=5)
    first = store.load_or_compile("h1", _slow_compile({"g": 1}), *_codec(calls))
    assert not first.from_disk and store.stats.num_saved == 1
    path = store.path("h1")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and "fake-1.0" in str(path) and FP[:32] in str(path)
    restarted = CompiledGrammarStore(tmp_path, "fake", "1.0", FP, min_compile_ms=5)
    again = restarted.load_or_compile("h1", lambda: 1 / 0, *_codec(calls))
    assert again.from_disk and again.compiled == {"g": 1}


def test_fast_grammars_are_not_written(tmp_path):
    store = CompiledGrammarStore(tmp_path, "fake", "1.0", FP, min_compile_ms=10_000)
    store.load_or_compile("h1", lambda: {"g": 1}, *_codec([]))
    assert not store.path("h1").exists()


def test_another_version_or_tokenizer_never_loads_it(tmp_path):
    CompiledGrammarStore(tmp_path, "fake", "1.0", FP, min_compile_ms=0).load_or_compile(
        "h1", lambda: {"g": 1}, *_codec([]))
    for other in (CompiledGrammarStore(tmp_path, "fake", "1.1", FP), CompiledGrammarStore(tmp_path, "fake", "1.0", "cd" * 32)):
        assert not other.load_or_compile("h1", lambda: {"g": 2}, *_codec([])).from_disk


def test_an_unreadable_file_is_dropped_and_compiled(tmp_path):
    store = CompiledGrammarStore(tmp_path, "fake", "1.0", FP, min_compile_ms=10_000)
    store.folder.mkdir(parents=True)
    store.path("h1").write_text("{truncated")
    loaded = store.load_or_compile("h1", lambda: {"g": 3}, *_codec([]))
    assert loaded.compiled == {"g": 3} and not loaded.from_disk and not store.path("h1").exists()


def test_an_entry_slower_to_load_than_to_compile_is_dropped(tmp_path):
    store = CompiledGrammarStore(tmp_path, "fake", "1.0", FP, min_compile_ms=0)
    store.folder.mkdir(parents=True)
    store.path("h1").write_text(json.dumps({"compile_ms": 0.0, "grammar": "[1]"}))

    def slow_load(text):
        time.sleep(0.01)
        return json.loads(text)
    assert store.load_or_compile("h1", lambda: 0, json.dumps, slow_load).from_disk
    assert not store.path("h1").exists() and store.stats.num_dropped == 1


def test_xgrammar_round_trip_gives_the_same_masks_but_is_not_offered(make_backend, tmp_path):
    backend = make_backend("xgrammar")
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    store = CompiledGrammarStore(tmp_path, "xgrammar", "0.2.9", FP, min_compile_ms=0)
    codec = xgrammar_codec(backend.tokenizer_info)
    compiled = store.load_or_compile("h1", lambda: backend.compile(spec), *codec).compiled
    reloaded = CompiledGrammarStore(tmp_path, "xgrammar", "0.2.9", FP).load_or_compile("h1", lambda: 1 / 0, *codec)
    masks = np.zeros((2, backend.tokenizer.mask_words), np.int32)
    backend.batch_fill([backend.new_matcher(compiled), backend.new_matcher(reloaded.compiled)], masks, [0, 1])
    np.testing.assert_array_equal(masks[0], masks[1])
    # measured: loading xgrammar 0.2.9's JSON form is 6-30x slower than compiling (persist.py)
    assert codec_for(backend) is None and codec_for(make_backend("llguidance")) is None
