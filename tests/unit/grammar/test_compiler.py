"""The compiler: cache, shared in-flight compiles, timeout + negative cache, limits, bad input."""
from __future__ import annotations

import json
import threading
import time

import pytest
from prometheus_client import REGISTRY

from grammar_contract.spec import GrammarSpec
from grammar_service.backends.base import GrammarBackend
from grammar_service.compiler import CompileError, GrammarCompiler
from grammar_service.config import GrammarServiceConfig
from grammar_service.sandbox import SandboxError

PERSON = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})


def _big_schema(n: int = 150) -> str:
    kinds = [{"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "array", "items": {"type": "number"}},
             {"enum": ["a", "b", "c"]}, {"type": "object", "properties": {"x": {"type": "boolean"}}}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(n)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)[: n // 2]})


def _error(future) -> CompileError:
    with pytest.raises(CompileError) as info:
        future.result(30)
    return info.value


def test_same_spec_is_a_cache_hit_and_options_are_part_of_the_key(service):
    first = service.compile(GrammarSpec("json_schema", PERSON)).result(30)
    again = service.compile(GrammarSpec("json_schema", PERSON)).result(30)
    compact = service.compile(GrammarSpec("json_schema", PERSON, any_whitespace=False)).result(30)
    assert not first.cache_hit and again.cache_hit
    assert again.entry.grammar_id == first.entry.grammar_id
    assert compact.entry.grammar_id != first.entry.grammar_id
    assert service._compiler.get(first.entry.grammar_id) is first.entry


def test_concurrent_compiles_of_one_spec_share_one_future(service):
    compiles_before = service._compiler.stats.num_compiles
    spec = GrammarSpec("json_schema", _big_schema())
    futures = [service.compile(spec) for _ in range(6)]
    assert all(f is futures[0] for f in futures)
    ids = {f.result(60).entry.grammar_id for f in futures}
    assert len(ids) == 1
    assert service._compiler.stats.num_compiles == compiles_before + 1


class _SlowBackend(GrammarBackend):
    """Test double for the timeout path only: a compile that takes `delay_s`. The timeout tests
    name a backend: under `auto` a pick past its share of the timeout falls back to the next
    backend (grammar_service/backend_choice.py), here the same double compiling again."""
    name = "slow"

    def __init__(self, delay_s: float, gate: threading.Event | None = None):
        self.delay_s = delay_s
        self.gate = gate  # a compile also waits for this, when given
        self.num_calls = 0
        self.specs: list[str] = []

    def compile(self, spec):
        self.num_calls += 1
        self.specs.append(spec.text)
        time.sleep(self.delay_s)
        if self.gate is not None:
            self.gate.wait(10)
        return object()

    def new_matcher(self, compiled): raise NotImplementedError
    def batch_accept(self, matchers, token_ids): raise NotImplementedError
    def batch_fill(self, matchers, masks, indices): raise NotImplementedError
    def batch_rollback(self, matchers, num_tokens): raise NotImplementedError


def _timeouts_counted() -> float:
    return REGISTRY.get_sample_value("structgen_grammar_compile_requests_total",
                                     {"outcome": "timeout", "backend": "xgrammar"}) or 0.0


def test_compile_timeout_is_reported_and_remembered_for_the_ttl():
    now = [1000.0]
    backend = _SlowBackend(delay_s=1.0)
    config = GrammarServiceConfig(compile_timeout_s=0.2, negative_cache_ttl_s=60)
    compiler = GrammarCompiler(lambda name: backend, config, clock=lambda: now[0])
    started = time.monotonic()
    timeouts = _timeouts_counted()
    err = _error(compiler.compile(GrammarSpec("regex", "a+", backend="xgrammar")))
    assert time.monotonic() - started < 0.9
    assert err.status == "INVALID_ARGUMENT"
    assert "did not finish within the 0.2 s compile timeout" in err.message
    assert _timeouts_counted() == timeouts + 1  # counted apart from other errors
    # answered from the negative cache, without compiling again
    assert _error(compiler.compile(GrammarSpec("regex", "a+", backend="xgrammar"))).message == err.message
    assert backend.num_calls == 1 and compiler.num_negative == 1
    now[0] += 61  # past the TTL: compiled again
    backend.delay_s = 0.0
    assert compiler.compile(GrammarSpec("regex", "a+", backend="xgrammar")).result(5).cache_hit is False
    assert backend.num_calls == 2
    compiler.close()


def test_the_wait_for_a_thread_counts_against_the_timeout():
    gate = threading.Event()
    backend = _SlowBackend(delay_s=0.0, gate=gate)
    config = GrammarServiceConfig(num_compile_threads=1, compile_timeout_s=0.3, isolate_compiles=False)
    compiler = GrammarCompiler(lambda name: backend, config)
    compiler.compile(GrammarSpec("regex", "a", backend="xgrammar"))  # holds the only thread until the gate opens
    err = _error(compiler.compile(GrammarSpec("regex", "b", backend="xgrammar")))
    # "b" never reached the backend, yet its timeout ran out: the wait for the thread counted;
    # not the grammar's fault, so not remembered
    assert backend.specs == ["a"]
    assert err.status == "RESOURCE_EXHAUSTED" and "no compile thread became free" in err.message
    gate.set()
    assert compiler.compile(GrammarSpec("regex", "b")).result(5).cache_hit is False
    compiler.close()


def test_a_compile_the_queue_left_little_time_is_refused_for_capacity_not_remembered():
    """A grammar that waited most of its timeout for a thread and then ran out is not called too complex."""
    backend = _SlowBackend(delay_s=0.35)
    config = GrammarServiceConfig(num_compile_threads=1, compile_timeout_s=0.5, isolate_compiles=False)
    compiler = GrammarCompiler(lambda name: backend, config)
    first = compiler.compile(GrammarSpec("regex", "a", backend="xgrammar"))
    err = _error(compiler.compile(GrammarSpec("regex", "b", backend="xgrammar")))  # 0.35 s waiting, 0.15 s its own
    assert err.status == "RESOURCE_EXHAUSTED" and "which it waited for a worker" in err.message
    assert first.result(5) and compiler.num_negative == 0
    backend.delay_s = 0.0
    assert compiler.compile(GrammarSpec("regex", "b", backend="xgrammar")).result(5).cache_hit is False
    compiler.close()


class _TimedOutSandbox:
    """A sandbox whose worker ran out of time after `compile_s` of compiling."""

    def __init__(self, compile_s: float):
        self.compile_s = compile_s

    def probe(self, spec, requested, deadline):
        raise SandboxError("INVALID_ARGUMENT", "", is_grammar_fault=True, timed_out=True, compile_s=self.compile_s)

    def close(self):
        pass


@pytest.mark.parametrize("compile_s, status, num_remembered", [(1.0, "RESOURCE_EXHAUSTED", 0),
                                                               (10.0, "INVALID_ARGUMENT", 1)])
def test_a_worker_timeout_blames_the_grammar_only_when_it_compiled_most_of_the_timeout(compile_s, status,
                                                                                      num_remembered):
    compiler = GrammarCompiler(lambda name: _SlowBackend(0), GrammarServiceConfig(compile_timeout_s=10.0),
                               sandbox=_TimedOutSandbox(compile_s))
    assert _error(compiler.compile(GrammarSpec("regex", "a"))).status == status
    assert compiler.num_negative == num_remembered
    compiler.close()


def test_a_saturated_compiler_answers_resource_exhausted_at_once():
    backend = _SlowBackend(delay_s=0.5)
    config = GrammarServiceConfig(num_compile_threads=1, max_queued_compiles=1, isolate_compiles=False)
    compiler = GrammarCompiler(lambda name: backend, config)
    running, queued = compiler.compile(GrammarSpec("regex", "a")), compiler.compile(GrammarSpec("regex", "b"))
    started = time.monotonic()
    err = _error(compiler.compile(GrammarSpec("regex", "c")))
    assert time.monotonic() - started < 0.1
    assert err.status == "RESOURCE_EXHAUSTED" and "max_queued_compiles 1" in err.message
    assert compiler.compile(GrammarSpec("regex", "a")) is not None  # a spec in flight is shared, not refused
    assert running.result(5) and queued.result(5)
    assert compiler.compile(GrammarSpec("regex", "c")).result(5).cache_hit is False  # not remembered
    compiler.close()


def test_a_burst_of_new_grammars_as_large_as_a_batch_waits_with_the_defaults():
    """64 requests, each with its own schema, arrive at once: all compile, none is refused."""
    backend = _SlowBackend(delay_s=0.005)
    compiler = GrammarCompiler(lambda name: backend, GrammarServiceConfig(isolate_compiles=False))
    futures = [compiler.compile(GrammarSpec("regex", f"a{i}", backend="xgrammar")) for i in range(64)]
    assert all(not f.result(10).cache_hit for f in futures) and backend.num_calls == 64
    compiler.close()


def test_an_explicit_small_queue_still_refuses_a_burst_at_once():
    gate = threading.Event()
    backend = _SlowBackend(delay_s=0.0, gate=gate)  # accepted compiles hold their place until the gate opens
    config = GrammarServiceConfig(isolate_compiles=False, max_queued_compiles=4)
    compiler = GrammarCompiler(lambda name: backend, config)
    futures = [compiler.compile(GrammarSpec("regex", f"a{i}", backend="xgrammar")) for i in range(64)]
    refused = [f for f in futures if f.done() and f.exception() is not None]
    assert len(refused) == 64 - config.num_compile_threads - 4
    assert all(f.exception().status == "RESOURCE_EXHAUSTED" for f in refused)
    gate.set()
    assert sum(not f.result(10).cache_hit for f in futures if f not in refused) == config.num_compile_threads + 4
    compiler.close()


def test_grammar_text_over_the_size_limit_names_the_limit(mistral_32k_dir):
    compiler = GrammarCompiler(lambda name: _SlowBackend(0), GrammarServiceConfig(max_grammar_bytes=100))
    err = _error(compiler.compile(GrammarSpec("regex", "a" * 101)))
    assert err.status == "INVALID_ARGUMENT"
    assert err.message == "grammar text is 101 bytes, over the limit of 100 bytes (max_grammar_bytes)"
    err = _error(compiler.compile(GrammarSpec("choice", choices=("x" * 60, "y" * 60))))
    assert "120 bytes" in err.message
    compiler.close()


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", '{"type": "object",'), "json_schema: Failed to parse JSON: syntax error"),
    (GrammarSpec("json_schema", '{"type": "strnig"}'), "json_schema:"),
    (GrammarSpec("regex", "a(b"), "regex: Regex parsing error at position 4: The parenthesis is not closed."),
    (GrammarSpec("regex", "(?=a)b"), "regex: Regex parsing error at position 3: Lookahead is not supported yet."),
    (GrammarSpec("lark", "start: foo"), "lark: Lark error at line 1, column 8: unknown name 'foo'"),
    (GrammarSpec("structural_tag", '{"type": "x"}'), "structural_tag: Invalid structural tag error"),
    (GrammarSpec("regex", "a", backend="nope"), "unknown grammar backend 'nope'"),
])
def test_malformed_grammars_are_invalid_argument_with_the_backend_message(service, spec, message):
    err = _error(service.compile(spec))
    assert err.status == "INVALID_ARGUMENT"
    assert err.message.startswith(message), err.message
    assert "/project/cpp" not in err.message  # xgrammar's source locations are stripped
    # the service keeps working after the error
    assert service.compile(GrammarSpec("regex", "ok")).result(30).entry.grammar_id > 0


def test_a_failed_spec_is_answered_from_the_negative_cache(service):
    spec = GrammarSpec("regex", "b(c")
    first = _error(service.compile(spec))
    errors_before = service._compiler.stats.num_errors
    assert _error(service.compile(spec)).message == first.message
    assert service._compiler.stats.num_errors == errors_before


def test_each_kind_compiles(service):
    for spec in [GrammarSpec("json_object"), GrammarSpec("choice", choices=('say "hi"', "back\\slash", "é\n")),
                 GrammarSpec("lark", 'start: "a" b\nb: /[0-9]+/'), GrammarSpec("regex", r"\d{3}-\d{4}"),
                 GrammarSpec("json_schema", PERSON, max_whitespace=2),
                 GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": {
                     "type": "triggered_tags", "triggers": ["<f>"], "tags": [
                         {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
                          "end": "</f>"}]}}))]:
        assert service.compile(spec).result(30).entry.grammar_id > 0, spec


def test_auto_reports_the_backend_it_chose_and_its_gaps(service):
    schema = json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    outcome = service.compile(GrammarSpec("json_schema", schema)).result(60)
    # both leave uniqueItems unenforced: the tie goes to the faster compile (issue 8)
    assert outcome.entry.backend == "llguidance"
    assert [(u.keyword, u.pointer) for u in outcome.entry.unenforced] == [("uniqueItems", "")]
    assert service.compile(GrammarSpec("regex", "[0-9]{3}")).result(60).entry.backend == "xgrammar"
    with pytest.raises(CompileError, match=r"strict: .*uniqueItems at /"):
        service.compile(GrammarSpec("json_schema", schema, strict=True)).result(60)
    # strict is applied per caller: the cached grammar still serves non-strict requests
    assert service.compile(GrammarSpec("json_schema", schema)).result(60).cache_hit
