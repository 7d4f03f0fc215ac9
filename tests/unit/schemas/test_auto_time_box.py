"""`auto` does not wait on a slow compile it can do without: when a faster backend that compiles
the schema is there to serve, that one compiles first and the pick gets what is left of
`auto`'s budget; past it the faster one serves with its own gaps reported
(grammar_service/backend_choice.py)."""
from __future__ import annotations

import json
import time

import pytest

from benchmarks.corpus import get_schema
from grammar_contract.spec import GrammarSpec
from grammar_service.backend_choice import PICK_SHARE, compile_with
from grammar_service.backends.base import GrammarCompileError
from grammar_service.config import GrammarServiceConfig
from grammar_service.auto_choice import choose_backend
from grammar_service.service import GrammarService

from backend_vocab import VOCAB

# xgrammar leaves fewer keywords out of it than llguidance, which compiles it too
METASCHEMA_7 = json.loads(get_schema("metaschema-draft7").text)


def xgrammar_pick(test: str) -> GrammarSpec:
    """The schema with a property of its own: a grammar new to the service's cache per test."""
    properties = {**METASCHEMA_7["properties"], f"x-{test}": {"type": "string"}}
    return GrammarSpec("json_schema", json.dumps({**METASCHEMA_7, "properties": properties}))


BUDGET_S = 0.2  # xgrammar compiles the metaschema in ~0.7 s on 2 cores (the first time), llguidance in ~10 ms


class _Compiling:
    """A backend whose compile is replaced: slower by `sleep_s`, or failing (its analysis said
    it compiles). xgrammar caches compiled rules across schemas, so a slow compile in these
    tests is made, not hoped for."""

    def __init__(self, backend, *, sleep_s: float = 0.0, fails: bool = False):
        self._backend, self._sleep_s, self._fails = backend, sleep_s, fails

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def compile(self, spec):
        if self._fails:
            raise GrammarCompileError("injected")
        time.sleep(self._sleep_s)
        return self._backend.compile(spec)


def with_compile(make_backend, name: str, **how):
    return lambda n: _Compiling(make_backend(n), **how) if n == name else make_backend(n)


# 2020-12 applies the siblings of $ref: llguidance refuses them inside a cycle, only xgrammar compiles it
XGRAMMAR_ONLY = GrammarSpec("json_schema", json.dumps({"$defs": {"n": {"type": "object", "properties": {
    "c": {"$ref": "#/$defs/n", "minProperties": 1}}}}, "$ref": "#/$defs/n"}))


def test_the_pick_serves_when_it_compiles_within_its_box(make_backend):
    spec = xgrammar_pick("within")
    choice = choose_backend(spec, make_backend)
    assert choice.backend == "xgrammar" and choice.fast_fallback == "llguidance"
    done = compile_with(spec, "auto", make_backend, time_box_s=120)
    assert done.backend == "xgrammar" and done.abandoned is None and done.unenforced == choice.unenforced
    assert done.fallback_from == ""


def test_past_its_box_the_faster_backend_serves_with_its_own_gaps(make_backend):
    """The budget counts from the start (analysis and the fallback's compile included), so a
    boxed `auto` compile takes about the budget, not the budget plus the fallback's compile."""
    spec = xgrammar_pick("past")
    started = time.perf_counter()
    done = compile_with(spec, "auto", with_compile(make_backend, "xgrammar", sleep_s=1.0), time_box_s=BUDGET_S)
    elapsed = time.perf_counter() - started
    llguidance = make_backend("llguidance")
    assert done.backend == "llguidance" and done.fallback_from == "xgrammar"  # counted as a fallback
    assert done.unenforced == llguidance.unenforced_keywords(spec) and done.unenforced
    assert elapsed < BUDGET_S + 0.15, f"{elapsed:.3f} s for a {BUDGET_S} s budget"
    assert done.abandoned is not None
    done.abandoned.result(120)  # the boxed compile ran on in its thread, and finishes


def test_a_compile_timeout_near_falls_back_like_an_error(make_backend):
    """No time box: the pick may take what the compile timeout leaves once the fallback compiled;
    when nothing is left, the pick is not even started (it cannot win)."""
    spec = xgrammar_pick("timeout")
    done = compile_with(spec, "auto", make_backend, time_box_s=0, deadline=time.monotonic() + 1e-3)
    assert done.backend == "llguidance" and done.abandoned is None


def test_a_fallback_that_fails_after_all_leaves_the_pick_unboxed(make_backend):
    spec = xgrammar_pick("fallback fails")
    done = compile_with(spec, "auto", with_compile(make_backend, "llguidance", fails=True), time_box_s=1e-6)
    assert done.backend == "xgrammar" and done.abandoned is None


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
                                              num_compile_threads=1, auto_time_box_s=BUDGET_S))
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


# both enforce all of it: llguidance, the faster compiler, is the pick and xgrammar its fallback
PLAIN = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))


def test_a_fast_pick_past_its_share_of_the_timeout_falls_back_like_an_error(make_backend):
    """llguidance picked, and running away: at PICK_SHARE of the time to the deadline xgrammar
    compiles instead, rather than the request failing at the timeout."""
    choice = choose_backend(PLAIN, make_backend)
    assert choice.backend == "llguidance" and choice.fallbacks == ("xgrammar",) and not choice.fast_fallback
    timeout_s = 0.8
    started = time.perf_counter()
    done = compile_with(PLAIN, "auto", with_compile(make_backend, "llguidance", sleep_s=5.0),
                        deadline=time.monotonic() + timeout_s)
    elapsed = time.perf_counter() - started
    assert done.backend == "xgrammar" and done.unenforced == make_backend("xgrammar").unenforced_keywords(PLAIN)
    assert elapsed < timeout_s * PICK_SHARE + 0.3, f"{elapsed:.3f} s: the fallback starts at the pick's share"
    assert done.abandoned is not None and not done.abandoned.done()


def test_a_fast_pick_within_its_share_serves(make_backend):
    done = compile_with(PLAIN, "auto", with_compile(make_backend, "llguidance", sleep_s=0.1),
                        deadline=time.monotonic() + 60)
    assert done.backend == "llguidance" and done.abandoned is None


def test_when_the_fallback_fails_too_the_running_pick_still_serves(make_backend):
    how = with_compile(make_backend, "llguidance", sleep_s=0.5)
    both = lambda n: _Compiling(make_backend(n), fails=True) if n == "xgrammar" else how(n)  # noqa: E731
    done = compile_with(PLAIN, "auto", both, deadline=time.monotonic() + 0.2)
    assert done.backend == "llguidance" and done.abandoned is None
