"""Honest guarantee reports: what llguidance does not enforce is reported with its pointer,
what it enforces is not; strict requests are refused listing each keyword; `auto` ranks."""
from __future__ import annotations

import json

import pytest

from benchmarks.corpus import get_schema
from grammar_contract.report import UnenforcedKeyword
from grammar_contract.spec import GrammarSpec
from grammar_service.compiler import CompileError
from grammar_service.config import GrammarServiceConfig
from grammar_service.auto_choice import Candidate, choose_backend, num_gaps, rank
from grammar_service.guarantees import reconcile_llguidance_warnings
from grammar_service.service import GrammarService

EOS, VOCAB = 2, 32768  # "</s>" and the size of the Mistral v3 vocabulary (conftest.py)

D7 = "http://json-schema.org/draft-07/schema#"
OBJ_AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
# (keyword, pointer, schema, a document violating only that keyword)
NOT_ENFORCED = [
    ("uniqueItems", "/properties/tags", {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}, {"tags": [1, 1]}),
    ("not", "", {"type": "string", "not": {"const": "a"}}, "a"),
    ("if", "", {"type": "object", "properties": OBJ_AB, "if": {"properties": {"a": {"const": 1}},
                "required": ["a"]}, "then": {"required": ["b"]}}, {"a": 1}),
    ("propertyNames", "/$defs/m", {"$ref": "#/$defs/m", "$defs": {"m": {
        "type": "object", "propertyNames": {"pattern": "^x"}}}}, {"y": 1}),
    ("dependencies", "", {"$schema": D7, "type": "object", "properties": OBJ_AB,
                          "dependencies": {"a": ["b"]}}, {"a": 1}),
    ("dependentRequired", "", {"type": "object", "properties": OBJ_AB, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    ("contains", "/items/0", {"$schema": D7, "type": "array", "items": [
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}]}, [[2]]),
    ("oneOf", "", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1),
    ("unevaluatedProperties", "", {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
     {"b": 1}),
    ("format", "/properties/r", {"type": "object", "properties": {"r": {"type": "string", "format": "regex"}}},
     {"r": "("}),
    ("maxProperties", "", {"type": "object", "properties": OBJ_AB, "maxProperties": 1}, {"a": 1, "b": 2}),
    # dropped so that llguidance compiles the schema at all (backends/llguidance_schema.py)
    ("pattern", "/properties/index", {"type": "object", "properties": {"index": {
        "type": "string", "pattern": "^(?!lucene\\.)[a-z.]+$"}}}, {"index": "lucene.x"}),
]
# Keywords llguidance does enforce (xgrammar does not, for several): no report, violation refused.
ENFORCED = [
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]}, {"a": 1}),
    ({"type": "number", "multipleOf": 0.5}, 0.3),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, "ab"),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, "abc"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, True),
    ({"type": "object", "minProperties": 1}, {}),
    ({"type": "object", "properties": OBJ_AB, "minProperties": 1, "additionalProperties": False}, {}),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False}, {"x": "s"}),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "maximum": 3,
      "exclusiveMaximum": True}, 3),
]


@pytest.fixture(scope="module")
def llg(make_backend):
    return make_backend("llguidance")


def _accepts(backend, schema: dict, doc) -> bool:
    matcher = backend.new_matcher(backend.compile(GrammarSpec("json_schema", json.dumps(schema))))
    ids = backend.lltokenizer.greedy_tokenize(json.dumps(doc))
    return all(matcher.accept(t) for t in ids) and matcher.accept(EOS)


@pytest.mark.parametrize("keyword,pointer,schema,violating", NOT_ENFORCED, ids=[c[0] for c in NOT_ENFORCED])
def test_unenforced_keyword_is_reported_where_it_is(llg, keyword, pointer, schema, violating):
    assert _accepts(llg, schema, violating), "the grammar really lets the violation through"
    reported = llg.unenforced_keywords(GrammarSpec("json_schema", json.dumps(schema)))
    assert (keyword, pointer) in {(u.keyword, u.pointer) for u in reported}


@pytest.mark.parametrize("schema,violating", ENFORCED)
def test_enforced_keywords_are_not_reported(llg, schema, violating):
    assert not _accepts(llg, schema, violating)
    assert llg.unenforced_keywords(GrammarSpec("json_schema", json.dumps(schema))) == ()


def test_a_warning_the_walk_missed_is_still_reported():
    found = (UnenforcedKeyword("uniqueItems", "/items", "x"),)
    merged = reconcile_llguidance_warnings(found, ['Unimplemented keys: ["uniqueItems"]',
                                                   'Unimplemented keys: ["madeUpKeyword"] (2 times)'])
    assert [(u.keyword, u.pointer) for u in merged] == [("uniqueItems", "/items"), ("madeUpKeyword", "")]
    assert "location unknown" in merged[1].reason


def test_exact_oneof_is_not_reported():
    found = (UnenforcedKeyword("oneOf", "/x", "anyOf"),)
    assert reconcile_llguidance_warnings(found, []) == ()  # llguidance proved it exact: no warning


@pytest.fixture(scope="module")
def service(mistral_32k_dir):
    svc = GrammarService(GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB))
    yield svc
    svc.close()


@pytest.mark.parametrize("name", ["citation-file-format", "readthedocs", "snapcraft"])
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_strict_refuses_listing_every_unenforced_keyword_with_its_pointer(service, name, backend):
    text = get_schema(name).text
    unenforced = service._backend(backend).unenforced_keywords(GrammarSpec("json_schema", text))
    assert unenforced, f"{name} has keywords {backend} cannot enforce"
    with pytest.raises(CompileError) as refused:
        service.compile(GrammarSpec("json_schema", text, strict=True, backend=backend)).result(30)
    assert refused.value.status == "INVALID_ARGUMENT"
    for u in unenforced:
        assert f"{u.keyword} at {u.pointer or '/'}" in refused.value.message


def test_strict_accepts_a_schema_the_backend_fully_enforces(service):
    text = get_schema("cloudbuild").text
    outcome = service.compile(GrammarSpec("json_schema", text, strict=True, backend="llguidance")).result(30)
    assert outcome.entry.backend == "llguidance" and outcome.entry.unenforced == ()


# --- auto --------------------------------------------------------------------------------
def test_rank_prefers_fewer_gaps_then_speed():
    gap = (UnenforcedKeyword("not", "/a"),)
    slow_exact = Candidate("xgrammar", (), speed_rank=1)
    fast_gap = Candidate("llguidance", gap, speed_rank=0)
    assert rank([fast_gap, slow_exact]).backend == "xgrammar"
    choice = rank([Candidate("llguidance", gap, speed_rank=0), Candidate("xgrammar", gap, speed_rank=1)])
    assert choice.backend == "llguidance" and "compiles faster" in choice.reason and choice.fallbacks == ("xgrammar",)
    broken = rank([Candidate("llguidance", (), error="schema too large"), Candidate("xgrammar", gap, speed_rank=1)])
    assert broken.backend == "xgrammar" and "schema too large" in broken.reason


def test_if_then_else_counts_as_one_gap():
    assert num_gaps((UnenforcedKeyword("if", ""), UnenforcedKeyword("then", ""), UnenforcedKeyword("else", ""))) == 1


@pytest.mark.parametrize("name,expected", [
    ("drone-ci", "llguidance"),        # xgrammar merges allOf partially; llguidance intersects
    ("cloudbuild", "llguidance"),      # both enforce all of it; llguidance compiles in ms
    ("circle-ci", "llguidance"),       # draft-07: $ref siblings ignored, so llguidance compiles its cycles
    ("metaschema-draft7", "xgrammar"),  # llguidance leaves two more keywords out
])
def test_auto_picks_per_schema_and_says_why(service, name, expected):
    choice = choose_backend(GrammarSpec("json_schema", get_schema(name).text), service._backend)
    assert choice.backend == expected and choice.reason.startswith(f"auto chose {expected}")


def test_auto_takes_xgrammar_where_llguidance_refuses_the_schema(service):
    """2020-12 applies the siblings of `$ref`; llguidance refuses them inside a cycle."""
    schema = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n", "minProperties": 1}}}},
              "$ref": "#/$defs/n"}
    choice = choose_backend(GrammarSpec("json_schema", json.dumps(schema)), service._backend)
    assert choice.backend == "xgrammar" and "circular references with sibling keys" in choice.reason


@pytest.mark.parametrize("name", ["cloudbuild", "drone-ci", "circle-ci", "taskfile"])
def test_the_compiler_applies_choose_backends_order_unchanged(service, name):
    """One function decides `auto`: the compile pool tries exactly choose_backend's order."""
    from grammar_service.backend_choice import auto_order

    spec = GrammarSpec("json_schema", get_schema(name).text)
    choice = choose_backend(spec, service._backend)
    order, known = auto_order(spec, service._backend)
    assert order == (choice.backend, *choice.fallbacks) and known == {choice.backend: choice.unenforced}
