"""llguidance compiles schemas whose intersections it could not build, rewritten into equal ones
(grammar_service/backends/llguidance_intersections.py): each shape below is a small copy of a
corpus schema llguidance refused, so `auto` served it with xgrammar in seconds. Each compiles
now, and the documents the schema accepts (checked by a validator) pass, those it refuses do not."""
from __future__ import annotations

import json

import jsonschema
import pytest

from documents import accepts
from grammar_contract.spec import GrammarSpec
from grammar_service.auto_choice import choose_backend
from grammar_service.backends.llguidance_schema import for_llguidance
from grammar_service.look_around import with_literal_braces

DRAFT_7 = "http://json-schema.org/draft-07/schema#"

# Serverless: keywords beside an anyOf whose reference branch reaches back while being compiled.
CYCLE_BESIDE_ANY_OF = {"$schema": DRAFT_7, "$ref": "#/definitions/call", "definitions": {
    "expr": {"type": ["string", "object"], "anyOf": [{"type": "string"}, {"$ref": "#/definitions/call"}]},
    "call": {"type": "object", "required": ["f"], "additionalProperties": False,
             "properties": {"f": {"type": "array", "items": {"$ref": "#/definitions/expr"}}}}}}
# vega: an allOf branch that refers back to the schema being compiled.
CYCLE_IN_ALL_OF = {"$ref": "#/definitions/scope", "definitions": {
    "scope": {"type": "object", "properties": {"marks": {"type": "array", "items": {"$ref": "#/definitions/group"}}}},
    "group": {"allOf": [{"required": ["kind"], "properties": {"kind": {"const": "group"}}},
                        {"$ref": "#/definitions/scope"}, {"properties": {"name": {"type": "string"}}}]}}}
# Camel YAML DSL: a parent declares a recursive property exactly as its anyOf branch does.
STEPS = {"type": "array", "items": {"$ref": "#/definitions/step"}}
REPEATED_RECURSIVE = {"$schema": DRAFT_7, "$ref": "#/definitions/route", "definitions": {
    "step": {"type": "object", "properties": {"steps": STEPS, "name": {"type": "string"}}},
    "base": {"type": "object", "required": ["steps"], "properties": {"steps": STEPS}},
    "route": {"type": "object", "required": ["uri"], "anyOf": [{"$ref": "#/definitions/base"}],
              "properties": {"steps": STEPS, "uri": {"type": "string"}}}}}
# template.json: the same, where the parent's property is itself a reference's target.
REPEATED_TARGET = {"type": "object", "properties": {"source": {"$ref": "#/definitions/source"}}, "definitions": {
    "source": {"type": "object", "allOf": [{"$ref": "#/definitions/modifier"}],
               "properties": {"modifiers": {"type": "array", "items": {"$ref": "#/definitions/modifier"}},
                              "path": {"type": "string"}}},
    "modifier": {"type": "object", "properties": {"modifiers": {"$ref": "#/definitions/source/properties/modifiers"},
                                                  "condition": {"type": "string"}}}}}
# Azure Pipelines: a property enum of N names under an anyOf of N branches, one per name (N² nodes).
NAMES = [f"Task{i}@1" for i in range(230)]
ENUM_TIMES_BRANCHES = {"type": "object", "additionalProperties": False, "required": ["task"],
                       "properties": {"task": {"anyOf": [{"enum": [n], "description": n} for n in NAMES]},
                                      "inputs": {"type": "object"}},
                       "anyOf": [{"required": ["task"], "properties": {
                           "task": {"pattern": f"^{n}$"}, "inputs": {"properties": {"x": {"type": "integer"}}}}}
                                 for n in [*NAMES, "Gone@1"]]}
# SWADL: declared activities hold the schema every custom activity (a name pattern) takes, and
# match that pattern too: each intersects it with itself, a product of its event branches.
EVENTS = {f"event{i}": {"type": "object", "additionalProperties": False, "properties": {f"e{i}": {
    "type": "object", "properties": {"user": {"type": "string", "pattern": "^[a-z]+@[a-z]+$"}}}}} for i in range(60)}
PATTERN_REPEATS = {"type": "object", "additionalProperties": False, "maxProperties": 1,
                   "properties": {f"make-{j}": {"allOf": [{"$ref": "#/definitions/common"}, {"$ref": "#/definitions/named"}]}
                                  for j in range(6)},
                   "patternProperties": {"^(?!send)[a-z0-9-]+$": {"$ref": "#/definitions/common"}},
                   "definitions": {**EVENTS, "named": {"type": "object", "properties": {"name": {"type": "string"}}},
                                   "on": {"type": "object", "oneOf": [{"$ref": f"#/definitions/{e}"} for e in EVENTS]},
                                   "common": {"type": "object", "required": ["id"], "properties": {
                                       "id": {"type": "string"}, "on": {"$ref": "#/definitions/on"}}}}}

CASES = {  # schema, valid documents, invalid documents
    "cycle beside anyOf": (CYCLE_BESIDE_ANY_OF, [{"f": ["x", {"f": []}]}], [{"f": [1]}, {"f": [{"g": 1}]}, {}]),
    "cycle in allOf": (CYCLE_IN_ALL_OF, [{"marks": [{"kind": "group", "name": "a", "marks": [{"kind": "group"}]}]}],
                       [{"marks": [{"name": "a"}]}, {"marks": [{"kind": "group", "marks": [{"kind": "x"}]}]}]),
    "repeated recursive": (REPEATED_RECURSIVE, [{"steps": [{"steps": [{}], "name": "a"}], "uri": "u"}],
                           [{"uri": "u"}, {"uri": "u", "steps": [{"name": 1}]}, {"steps": []}]),
    "repeated target": (REPEATED_TARGET, [{"source": {"modifiers": [{"modifiers": [], "condition": "c"}], "path": "p"}}],
                        [{"source": {"modifiers": [{"condition": 1}]}}, {"source": {"modifiers": {}}}]),
    "enum times branches": (ENUM_TIMES_BRANCHES, [{"task": "Task7@1", "inputs": {"x": 1}}, {"task": "Task229@1"}],
                            [{"task": "Gone@1"}, {"task": "Task7@2"}, {"task": 7}, {"task": "Task7@1", "inputs": {"x": "1"}}]),
    "pattern repeats": (PATTERN_REPEATS, [{"make-0": {"id": "a"}}, {"custom-x": {"id": "b"}}],
                        [{"make-0": {}}, {"make-1": {"id": "a", "name": 1}}, {"send": {"id": "a"}},
                         {"make-0": {"id": "a", "on": {"e3": {"user": "x"}}}}]),
}


@pytest.mark.parametrize("name", CASES)
def test_llguidance_compiles_what_it_could_not_intersect_and_means_the_same(make_backend, tokenize, name):
    schema, valid, invalid = CASES[name]
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert all(validator.is_valid(d) for d in valid) and not any(validator.is_valid(d) for d in invalid)
    llguidance = make_backend("llguidance")
    for document in valid:
        assert accepts(llguidance, schema, document, tokenize), document
    for document in invalid:
        assert not accepts(llguidance, schema, document, tokenize), document
    choice = choose_backend(GrammarSpec("json_schema", json.dumps(schema)), make_backend)
    assert choice.backend == "llguidance", choice.reason


def test_keywords_stay_beside_an_any_of_where_a_reference_target_needs_them():
    """`minLength` says something about a string target: moving it would be a weakening."""
    schema = json.loads(json.dumps(CYCLE_BESIDE_ANY_OF))
    schema["definitions"]["expr"]["anyOf"].append({"$ref": "#/definitions/word"})
    schema["definitions"]["word"] = {"type": "string"}
    schema["definitions"]["expr"]["minLength"] = 2
    assert json.loads(for_llguidance(json.dumps(schema)))["definitions"]["expr"]["minLength"] == 2


@pytest.mark.parametrize("pattern,spelled", [
    ("^(\\${.*\\})$", "^(\\$\\{.*\\})$"),   # a brace that starts no quantifier is text
    ("^a{2,3}b{1}$", "^a{2,3}b{1}$"),       # quantifiers stay
    ("^[{]x{,3}$", "^[{]x\\{,3}$"),         # inside a class it is text already; "{,3}" is text
])
def test_a_literal_brace_is_escaped_and_nothing_else(pattern, spelled):
    assert with_literal_braces(pattern) == spelled


def test_a_pattern_with_a_literal_brace_compiles_in_llguidance(make_backend, tokenize):
    """Serverless's `\\${.*\\}` (ECMA-262 reads the brace as text; llguidance refused it), in a
    value and in a property name."""
    schema = {"type": "string", "pattern": "^(\\${.*\\})$"}
    llguidance = make_backend("llguidance")
    assert accepts(llguidance, schema, "${a}", tokenize)
    assert not accepts(llguidance, schema, "a", tokenize)
    named = {"type": "object", "additionalProperties": False, "patternProperties": {"^\\${{x}}$": {"type": "integer"}}}
    assert accepts(llguidance, named, {"${{x}}": 1}, tokenize)
    assert not accepts(llguidance, named, {"${{x}}": "1"}, tokenize)
    assert not accepts(llguidance, named, {"x": 1}, tokenize)


def test_a_parent_enum_that_says_more_than_its_values_stays():
    """`maxLength` beside the enum narrows it further: the branch's literal may not satisfy it."""
    schema = json.loads(json.dumps(ENUM_TIMES_BRANCHES))
    schema["properties"]["task"]["maxLength"] = 7
    assert json.loads(for_llguidance(json.dumps(schema)))["properties"]["task"] == schema["properties"]["task"]
    assert json.loads(for_llguidance(json.dumps(ENUM_TIMES_BRANCHES)))["properties"]["task"] == {"type": "string"}
