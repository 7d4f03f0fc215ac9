"""`allOf` object branches fold into one object exactly where they can
(grammar_service/allof_merge.py): jsonschema calls the same instances valid before and after
the fold, and both backends then take a valid document and refuse an invalid one through the
real grammar service compile and mask; where a fold would not be exact the branch stays, and
the report names what the grammar does with it."""
from __future__ import annotations

import json

import jsonschema
import pytest

from documents import takes
from grammar_contract.spec import GrammarSpec
from grammar_service.allof_merge import fold_all_of
from grammar_service.config import GrammarServiceConfig
from grammar_service.restrictions import json_restrictions
from grammar_service.schema_drafts import as_drafted
from grammar_service.service import GrammarService

from backend_vocab import VOCAB

A = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
B = {"properties": {"b": {"type": "integer"}}, "required": ["b"]}
INSTANCES = [{"a": "x", "b": 1}, {"b": 1, "a": "x"}, {"a": "x"}, {"b": 1}, {"a": 1, "b": 1}, {"a": "x", "b": "y"},
             {"a": "x", "b": 1, "c": True}, {"a": "x", "b": 1.5}, {"a": "", "b": 0, "c": 1}, [], "a", None]

# (id, schema, folds into one object: no allOf left)
SCHEMAS = [
    ("two-branches", {"allOf": [A, B]}, True),
    ("typed-parent", {"type": "object", "allOf": [A, B]}, True),
    ("parent-properties", {"properties": {"c": {"type": "boolean"}}, "allOf": [A, B]}, True),
    ("refs", {"$defs": {"A": A, "B": B}, "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}, True),
    ("same-name-intersects", {"allOf": [A, {"properties": {"a": {"maxLength": 1}, "b": {"type": "integer"}}}]}, True),
    ("number-and-integer", {"allOf": [{"properties": {"b": {"type": "number"}}},
                                      {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, True),
    ("closed-covering-branch", {"allOf": [{**A, "properties": {"a": {"type": "string"}, "b": {}}, "additionalProperties": False},
                                          B]}, True),
    # a closed branch that does not declare `b` forbids it: folding would let `b` through
    ("closed-branch-missing-a-name", {"allOf": [{**A, "additionalProperties": False}, B]}, False),
    ("open-rule-missing-a-name", {"allOf": [{**A, "additionalProperties": {"type": "integer"}}, B]}, False),
    ("two-rules", {"allOf": [{"additionalProperties": {"type": "integer"}}, {"additionalProperties": {"minimum": 1}}]},
     False),
    ("same-keyword-twice", {"allOf": [{"minProperties": 1}, {"minProperties": 3}]}, False),
    ("draft-4-exclusive-bound", {"properties": {"b": {"allOf": [{"maximum": 1}, {"exclusiveMaximum": True}]}}}, False),
    ("recursive-ref", {"$defs": {"T": {"properties": {"t": {"$ref": "#/$defs/T"}}}},
                       "allOf": [{"$ref": "#/$defs/T"}, B]}, False),
]


@pytest.mark.parametrize("name,schema,folds", SCHEMAS, ids=[c[0] for c in SCHEMAS])
def test_a_fold_keeps_every_instance_valid_or_invalid_as_it_was(name, schema, folds):
    folded = json.loads(json.dumps(schema))
    fold_all_of(folded)
    assert ("allOf" not in json.dumps(folded)) == folds, folded
    check = jsonschema.Draft4Validator if "exclusive" in name else jsonschema.Draft202012Validator
    before, after = check(schema), check(folded)
    assert [before.is_valid(i) for i in INSTANCES] == [after.is_valid(i) for i in INSTANCES]


def test_what_does_not_fold_stays_a_branch_and_what_does_moves_up():
    folded = json.loads(as_drafted(json.dumps({"allOf": [{**A, "additionalProperties": False}, B]})))
    assert folded == {**A, "additionalProperties": False, "allOf": [B]}


@pytest.fixture(scope="module")
def service(mistral_32k_dir):
    svc = GrammarService(GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB))
    yield svc
    svc.close()


def _compiled(service, schema: dict, backend: str):
    entry = service.compile(GrammarSpec("json_schema", json.dumps(schema), backend=backend)).result(60).entry
    return entry, *service._lookup_grammar(entry.grammar_id)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "auto"])
@pytest.mark.parametrize("name", ["two-branches", "refs"])
def test_properties_split_across_all_of_are_enforced_by_each_backend(service, tokenize, backend, name):
    schema = dict((c[0], c[1]) for c in SCHEMAS)[name]
    entry, matcher_backend, compiled = _compiled(service, schema, backend)
    assert entry.unenforced == (), "the folded object is compiled exactly"
    assert ("properties", "") in {(r.keyword, r.pointer) for r in entry.restricted}, "its order is named"
    validator = jsonschema.Draft202012Validator(schema)
    for document, valid in [({"a": "x", "b": 1}, True), ({"a": "x", "b": 1, "c": True}, True),
                            ({"a": "x"}, False), ({"a": "x", "b": "y"}, False), ({"b": 1}, False)]:
        assert validator.is_valid(document) == valid
        text = json.dumps(document, separators=(",", ":"))
        assert takes(matcher_backend, compiled, text, tokenize) == valid, (backend, text)


@pytest.mark.parametrize("backend,document", [("xgrammar", {"a": "x", "b": 1}), ("llguidance", {"b": 1, "a": "x"})])
def test_a_valid_order_an_unfolded_all_of_refuses_is_named(service, tokenize, backend, document):
    schema = {"type": "object", "allOf": [{"properties": {"a": {"type": "string"}},
                                           "additionalProperties": {"type": "integer"}}, B]}
    assert jsonschema.Draft202012Validator(schema).is_valid(document)
    entry, matcher_backend, compiled = _compiled(service, schema, backend)
    assert not takes(matcher_backend, compiled, json.dumps(document, separators=(",", ":")), tokenize)
    assert ("allOf", "") in {(r.keyword, r.pointer) for r in json_restrictions(as_drafted(json.dumps(schema)))}
    assert ("allOf", "") in {(r.keyword, r.pointer) for r in entry.restricted}
