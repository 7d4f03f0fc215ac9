"""The guarantee report names what the grammar refuses that the schema allows: each class
below is a valid document that both backends refuse, and the report names it where it applies;
`strict` does not refuse for it (the output still matches the schema)."""
from __future__ import annotations

import json

import pytest

from documents import accepts
from grammar_contract.spec import GrammarSpec
from grammar_service.config import GrammarServiceConfig
from grammar_service.restrictions import json_restrictions
from grammar_service.service import GrammarService
from structgen.schema_validation import validate_output

from backend_vocab import VOCAB

AB = {"a": {"type": "integer"}, "b": {"type": "string"}}
# (keyword, pointer, schema, a valid document in the form the grammar refuses)
RESTRICTED = [
    ("properties", "/properties/o", {"type": "object", "properties": {"o": {"type": "object", "properties": AB}}},
     {"o": {"b": "x", "a": 1}}),
    ("additionalProperties", "", {"type": "object", "properties": AB}, {"z": 1, "a": 1}),
    ("type", "", {"type": "integer"}, 6000.0),
    ("const", "", {"const": 0}, 0.0),
    ("enum", "/items", {"type": "array", "items": {"enum": [1, 2]}}, [2.0]),
]


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("keyword,pointer,schema,document", RESTRICTED, ids=[c[0] for c in RESTRICTED])
def test_a_valid_document_the_grammar_refuses_is_named(make_backend, tokenize, backend_name, keyword, pointer,
                                                       schema, document):
    text = json.dumps(schema)
    assert validate_output(text, json.dumps(document)).valid
    assert not accepts(make_backend(backend_name), schema, document, tokenize), \
        f"{backend_name} now takes this form: drop the class from grammar_service/restrictions.py"
    assert (keyword, pointer) in {(r.keyword, r.pointer) for r in json_restrictions(text)}


# one backend's classes: (backend, keyword, pointer, schema, a valid document it refuses)
BACKEND_RESTRICTED = [
    ("xgrammar", "type", "", {"properties": {"a": {"type": "integer"}}}, 5),
    ("xgrammar", "type", "/items", {"type": "array", "items": {"items": {"type": "integer"}}}, ["x"]),
    ("xgrammar", "format", "", {"type": "string", "format": "uri-reference"}, "http://example.com/a?b=1"),
    ("xgrammar", "pattern", "", {"type": "string", "pattern": "b"}, "abc"),
    ("xgrammar", "patternProperties", "", {"type": "object", "patternProperties": {"b": {"type": "integer"}},
                                           "additionalProperties": False}, {"abc": 1}),
    # an escape sequence in a name under a pattern that takes it (beside properties, closed)
    ("xgrammar", "patternProperties", "", {"type": "object", "properties": AB, "additionalProperties": False,
                                           "patternProperties": {"^b\\..+$": {"type": "string"}}}, {"b.x\ty": "s"}),
    ("xgrammar", "pattern", "", {"type": "string", "pattern": "^[a-z\"]+$"}, 'a"b'),
    ("xgrammar", "maxLength", "", {"type": "string", "maxLength": 10}, "a\\b"),
    ("xgrammar", "minLength", "", {"type": "string", "minLength": 1}, 'say "hi"'),
    ("llguidance", "minProperties", "", {"type": "object", "minProperties": 1, "properties": AB}, {"a": 1}),
    ("llguidance", "minProperties", "", {"type": "object", "minProperties": 2, "required": ["a"], "properties": AB},
     {"a": 1, "b": "x"}),
]


@pytest.mark.parametrize("backend_name,keyword,pointer,schema,document", BACKEND_RESTRICTED,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(BACKEND_RESTRICTED)])
def test_a_valid_document_one_backend_refuses_is_named_for_it(make_backend, tokenize, backend_name, keyword,
                                                              pointer, schema, document):
    text = json.dumps(schema)
    assert validate_output(text, json.dumps(document)).valid
    assert not accepts(make_backend(backend_name), schema, document, tokenize), \
        f"{backend_name} now takes this form: drop the class from grammar_service/restrictions.py"
    assert (keyword, pointer) in {(r.keyword, r.pointer) for r in json_restrictions(text, backend_name)}
    other = "llguidance" if backend_name == "xgrammar" else "xgrammar"
    assert (keyword, pointer) not in {(r.keyword, r.pointer) for r in json_restrictions(text, other)}


def test_the_backend_classes_are_exact_where_measured(make_backend, tokenize):
    """llguidance counts toward minProperties right where the required ones reach it, or
    additionalProperties is false: nothing to name there."""
    for schema in ({"type": "object", "minProperties": 1, "required": ["a"], "properties": AB},
                   {"type": "object", "minProperties": 1, "properties": AB, "additionalProperties": False}):
        assert accepts(make_backend("llguidance"), schema, {"a": 1}, tokenize)
        assert "minProperties" not in {r.keyword for r in json_restrictions(json.dumps(schema), "llguidance")}


def test_each_class_is_named_once_with_a_count_of_its_other_places():
    schema = {"type": "object", "properties": {"p": {"type": "object", "properties": AB},
                                               "q": {"type": "object", "properties": AB}}}
    order = [r for r in json_restrictions(json.dumps(schema)) if r.keyword == "properties"]
    assert [r.pointer for r in order] == [""] and "2 more places" in order[0].reason


def test_a_closed_object_with_one_property_has_nothing_to_name():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}
    assert json_restrictions(json.dumps(schema)) == ()


@pytest.fixture(scope="module")
def service(mistral_32k_dir):
    svc = GrammarService(GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB))
    yield svc
    svc.close()


def test_strict_serves_a_schema_with_restrictions_only_and_reports_them(service):
    text = json.dumps({"type": "object", "properties": AB, "required": ["a", "b"]})
    outcome = service.compile(GrammarSpec("json_schema", text, strict=True)).result(60)
    assert outcome.entry.unenforced == ()
    assert {r.keyword for r in outcome.entry.restricted} == {"properties", "additionalProperties", "type"}
