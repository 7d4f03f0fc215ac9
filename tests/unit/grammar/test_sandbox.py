"""Compile workers: a grammar that crashes a backend, runs away or eats memory fails its own
compile only; the service keeps compiling everything else (grammar_service/sandbox.py)."""
from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
from prometheus_client import REGISTRY

from grammar_contract.spec import GrammarSpec
from grammar_service.compiler import CompileError
from grammar_service.config import GrammarServiceConfig
from grammar_service.emptiness import unproductive_rules
from grammar_service.service import GrammarService

VOCAB = 32768
PERSON = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})


def ref_chain(n: int) -> str:
    """$defs d0..dn, each an array of two $refs to the next: llguidance overflows its stack."""
    defs = {f"d{i}": {"type": "array", "prefixItems": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


def _error(future, timeout_s: float = 60) -> CompileError:
    with pytest.raises(CompileError) as info:
        future.result(timeout_s)
    return info.value


@pytest.fixture(scope="module")
def isolated(mistral_32k_dir):
    svc = GrammarService(GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB,
                                              compile_timeout_s=3.0, num_compile_threads=2))
    assert svc.wait_compile_ready(120)
    yield svc
    svc.close()


def test_a_grammar_that_crashes_its_backend_fails_alone(isolated):
    err = _error(isolated.compile(GrammarSpec("json_schema", ref_chain(2000), backend="llguidance")))
    assert err.status == "INVALID_ARGUMENT"
    assert "crashed the compiler (killed by SIGSEGV)" in err.message
    # the service and its cache are intact; the same grammar is answered from memory
    assert isolated.compile(GrammarSpec("json_schema", PERSON)).result(60).entry.grammar_id > 0
    replaced = isolated._compiler._sandbox.num_replaced
    assert _error(isolated.compile(GrammarSpec("json_schema", ref_chain(2000), backend="llguidance"))).message == err.message
    assert isolated._compiler._sandbox.num_replaced == replaced


def test_a_runaway_compile_is_killed_at_the_timeout_and_frees_its_worker(isolated):
    assert isolated.wait_compile_ready(120)  # the worker replaced after the crash is back
    huge = GrammarSpec("choice", choices=tuple(f"option {i}" for i in range(50_000)))
    err = _error(isolated.compile(huge))
    assert err.status == "INVALID_ARGUMENT" and "3 s compile timeout" in err.message
    replaced = isolated._compiler._sandbox.num_replaced
    assert replaced >= 1
    # both workers serve again (the killed one was replaced): two new grammars compile
    futures = [isolated.compile(GrammarSpec("regex", f"[a-z]{{{n}}}")) for n in (3, 4)]
    assert all(not f.result(30).cache_hit for f in futures)


def _compile_under_a_16_mb_cap(tokenizer_dir: str) -> tuple[str, str]:
    svc = GrammarService(GrammarServiceConfig(tokenizer_dir=tokenizer_dir, vocab_size=VOCAB,
                                              max_compile_memory_mb=16, num_compile_threads=1))
    assert svc.wait_compile_ready(120)
    try:
        err = _error(svc.compile(GrammarSpec("choice", choices=tuple(f"word{i}" for i in range(20_000)))))
        return err.status, err.message
    finally:
        svc.close()


def test_a_compile_over_the_memory_cap_fails_alone(mistral_32k_dir):
    # The cap counts address space a worker adds to what it inherits; a worker forked (through
    # the service's forker) from this test process would inherit the free heap the earlier tests
    # left, so the service runs in a fresh process, as grammar_service's own processes are.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        status, message = pool.submit(_compile_under_a_16_mb_cap, mistral_32k_dir).result(300)
    assert status == "INVALID_ARGUMENT"
    assert "max_compile_memory_mb" in message


@pytest.mark.parametrize("lark", ['start: a\na: a', 'start: "x" a\na: a', 'start: "x" | a\na: "y" a'])
def test_grammars_that_accept_nothing_are_refused_at_compile(isolated, lark):
    err = _error(isolated.compile(GrammarSpec("lark", lark)))
    assert err.status == "INVALID_ARGUMENT"
    assert "never reach a terminal" in err.message


@pytest.mark.parametrize("lark", ['start: "x" a\na: "b"* | a', 'start: e\ne: e "+" t | t\nt: /[0-9]+/'])
def test_recursive_grammars_that_can_finish_compile(isolated, lark):
    assert isolated.compile(GrammarSpec("lark", lark)).result(30).entry.grammar_id > 0


def test_the_ebnf_reader_finds_unproductive_rules_and_makes_no_claim_on_unreadable_text():
    assert unproductive_rules('root ::= (("x" a))\na ::= ((a))') == ["root", "a"]
    assert unproductive_rules('root ::= ((a) | ("y"))\na ::= ((a))') == ["a"]
    assert unproductive_rules('root ::= Regex("^x$", json_string=true)') == []
    assert unproductive_rules('root ::= @@@') is None


def optional_properties(n: int) -> str:
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}})


def test_auto_falls_back_when_llguidance_cannot_take_the_first_token(isolated):
    """llguidance compiles 500 optional properties but its parser refuses the first token (a
    row past its 2,000 items): `auto` then serves the schema with xgrammar."""
    counted = lambda: REGISTRY.get_sample_value(  # noqa: E731
        "structgen_grammar_backend_fallbacks_total", {"from_backend": "llguidance", "to_backend": "xgrammar"}) or 0
    before = counted()
    result = isolated.compile(GrammarSpec("json_schema", optional_properties(500))).result(60)
    assert result.entry.backend == "xgrammar" and result.entry.fallback_from == "llguidance"
    assert counted() == before + 1
    err = _error(isolated.compile(GrammarSpec("json_schema", optional_properties(500), backend="llguidance")))
    assert "llguidance matcher refuses the first token" in err.message and "try the other backend" in err.message


def test_when_no_backend_serves_one_line_names_each(isolated):
    """500 optional properties, one with a case-insensitive pattern: llguidance compiles it but its
    parser refuses the first token, xgrammar cannot compile the pattern's (?i); the one error
    names both."""
    schema = json.loads(optional_properties(500))
    schema["properties"]["code"] = {"type": "string", "pattern": "^(?i)abc$"}
    err = _error(isolated.compile(GrammarSpec("json_schema", json.dumps(schema))))
    assert err.status == "INVALID_ARGUMENT" and "\n" not in err.message
    assert err.message.startswith("json_schema: no grammar backend can serve it: llguidance: the llguidance "
                                  "matcher refuses the first token"), err.message
    assert "; xgrammar: " in err.message and "Group modifier flag is not supported" in err.message
