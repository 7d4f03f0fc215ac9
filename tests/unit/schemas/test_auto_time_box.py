"""`auto` does not wait on a slow compile it can do without: its pick's compile is time-boxed
when a faster backend that compiles the schema is there to serve, and past the box that one
serves with its own gaps reported (grammar_service/backend_choice.py)."""
from __future__ import annotations

import json
import time

import pytest

from benchmarks.corpus import get_schema
from grammar_contract.spec import GrammarSpec
from grammar_service.backend_choice import FALLBACK_RESERVE_S, compile_with
from grammar_service.config import GrammarServiceConfig
from grammar_service.auto_choice import choose_backend
from grammar_service.service import GrammarService

from backend_vocab import VOCAB

# xgrammar leaves fewer keywords out of it than llguidance, which compiles it too
METASCHEMA_7 = json.loads(get_schema("metaschema-draft7").text)


def xgrammar_pick(test: str) -> GrammarSpec:
    """The schema with a title of its own: xgrammar caches compiles by text, so that one test's
    compile would make the next one's instant."""
    return GrammarSpec("json_schema", json.dumps({**METASCHEMA_7, "title": test}))


# 2020-12 applies the siblings of $ref: llguidance refuses them inside a cycle, only xgrammar compiles it
XGRAMMAR_ONLY = GrammarSpec("json_schema", json.dumps({"$defs": {"n": {"type": "object", "properties": {
    "c": {"$ref": "#/$defs/n", "minProperties": 1}}}}, "$ref": "#/$defs/n"}))


def test_the_pick_serves_when_it_compiles_within_its_box(make_backend):
    spec = xgrammar_pick("within")
    choice = choose_backend(spec, make_backend)
    assert choice.backend == "xgrammar" and choice.fast_fallback == "llguidance"
    done = compile_with(spec, "auto", make_backend, time_box_s=120)
    assert done.backend == "xgrammar" and done.abandoned is None and done.unenforced == choice.unenforced


def test_past_its_box_the_faster_backend_serves_with_its_own_gaps(make_backend):
    spec = xgrammar_pick("past")
    done = compile_with(spec, "auto", make_backend, time_box_s=1e-6)
    llguidance = make_backend("llguidance")
    assert done.backend == "llguidance"
    assert done.unenforced == llguidance.unenforced_keywords(spec) and done.unenforced
    assert done.abandoned is not None
    done.abandoned.result(120)  # the boxed compile ran on in its thread, and finishes


def test_a_compile_timeout_near_falls_back_like_an_error(make_backend):
    """No time box: the pick may take what the timeout leaves, less the fallback's reserve."""
    spec = xgrammar_pick("timeout")
    deadline = time.monotonic() + FALLBACK_RESERVE_S + 1e-3
    done = compile_with(spec, "auto", make_backend, time_box_s=0, deadline=deadline)
    assert done.backend == "llguidance"
    done.abandoned.result(120)


def test_a_schema_only_the_pick_compiles_is_not_boxed(make_backend):
    assert choose_backend(XGRAMMAR_ONLY, make_backend).fast_fallback == ""
    done = compile_with(XGRAMMAR_ONLY, "auto", make_backend, time_box_s=1e-6)
    assert done.backend == "xgrammar" and done.abandoned is None


def test_a_named_backend_is_never_boxed(make_backend):
    spec = xgrammar_pick("named")
    done = compile_with(spec, "xgrammar", make_backend, time_box_s=1e-6)
    assert done.backend == "xgrammar" and done.abandoned is None


@pytest.fixture(scope="module")
def boxed_service(mistral_32k_dir):
    svc = GrammarService(GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB,
                                              num_compile_threads=1, auto_time_box_s=1e-6))
    assert svc.wait_compile_ready(120)
    yield svc
    svc.close()


def test_the_service_serves_the_fallback_and_replaces_the_busy_worker(boxed_service):
    spec = xgrammar_pick("service")
    sandbox = boxed_service._compiler._sandbox
    replaced = sandbox.num_replaced
    outcome = boxed_service.compile(spec).result(120)
    assert outcome.entry.backend == "llguidance" and outcome.entry.unenforced
    assert sandbox.num_replaced == replaced + 1, "the worker still compiling xgrammar was replaced"
    assert boxed_service.compile(spec).result(5).cache_hit
    assert boxed_service.wait_compile_ready(120), "the replacement worker starts"
    only = boxed_service.compile(XGRAMMAR_ONLY).result(120)
    assert only.entry.backend == "xgrammar"
