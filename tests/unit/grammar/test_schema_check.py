"""Malformed JSON Schemas are refused before any compile, with the JSON pointer of the fault."""
from __future__ import annotations

import json

import jsonschema
import pytest

from grammar_contract.spec import GrammarSpec
from grammar_service.backends.base import GrammarCompileError
from grammar_service.compiler import CompileError
from grammar_service.schema_check import check_schema

MALFORMED = [
    ({"type": "object", "properties": 5}, "/properties", '5 is not of type "object"'),
    ({"type": "array", "maxItems": "x"}, "/maxItems", '"x" is not of type "integer"'),
    ({"properties": {"a": {"type": "strin"}}}, "/properties/a/type", '"strin"'),
    ({"$defs": {"n": {"minLength": -1}}, "$ref": "#/$defs/n"}, "/$defs/n/minLength", "-1 is less than the minimum"),
    ({"required": "a"}, "/required", '"a" is not of type "array"'),
]


@pytest.mark.parametrize("schema,pointer,message", MALFORMED, ids=[m[1] for m in MALFORMED])
@pytest.mark.parametrize("backend", ["auto", "xgrammar", "llguidance"])
def test_a_malformed_schema_is_invalid_argument_naming_where(service, schema, pointer, message, backend):
    with pytest.raises(CompileError) as refused:
        service.compile(GrammarSpec("json_schema", json.dumps(schema), backend=backend)).result(60)
    assert refused.value.status == "INVALID_ARGUMENT"
    assert f"meta-schema (draft 2020-12) at {pointer}: " in refused.value.message
    assert message in refused.value.message


def test_the_compile_workers_live_on_after_malformed_schemas(service):
    """{"properties": 5} used to crash a compile worker in the guarantee analysis."""
    assert service.wait_compile_ready(60)
    workers = service._compiler._sandbox
    before = sorted(w.pid for w in workers._idle)
    for _ in range(3):
        with pytest.raises(CompileError, match="/properties"):
            service.compile(GrammarSpec("json_schema", '{"properties": 5, "maxProperties": 2}')).result(60)
    ok = service.compile(GrammarSpec("json_schema", '{"type": "object", "maxProperties": 2}')).result(60)
    assert ok.entry.grammar_id > 0
    assert sorted(w.pid for w in workers._idle) == before


@pytest.mark.parametrize("schema", [
    {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 0, "exclusiveMinimum": True},
    {"$schema": "https://json-schema.org/draft-07/schema#", "items": [{"type": "string"}]},  # https spelling
    {"$schema": "https://json-schema.org/draft/2019-09/schema", "$recursiveAnchor": True, "items": {"$recursiveRef": "#"}},
    {"type": "object", "properties": {"$ref": {"type": "string"}, "$id": {"type": "integer"}}},
    True,
])
def test_schemas_valid_under_their_own_draft_pass(schema):
    check_schema(json.dumps(schema))


def test_the_draft_named_is_the_schemas_own():
    with pytest.raises(GrammarCompileError, match=r"meta-schema \(draft-04\) at /minimum"):
        check_schema(json.dumps({"$schema": "http://json-schema.org/draft-04/schema#", "minimum": "0"}))
    with pytest.raises(GrammarCompileError, match="a schema is an object or a boolean, not list"):
        check_schema("[1, 2]")


@pytest.mark.parametrize("draft", ["http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-07/schema#",
                                   "https://json-schema.org/draft/2019-09/schema", None])
def test_the_check_judges_as_jsonschema_does(draft):
    """jsonschema-rs (milliseconds) against the jsonschema package (the final validation's)."""
    cases = [*(m[0] for m in MALFORMED), jsonschema.Draft7Validator.META_SCHEMA, {"enum": "x"},
             {"prefixItems": [{"type": "string"}], "unevaluatedItems": False}, {"dependentRequired": {"a": ["b", "b"]}},
             {"type": ["string", "string"]}, {"allOf": []}, {"minimum": "0"}, {"items": [{"type": "string"}]},
             {"exclusiveMinimum": True, "minimum": 0}, {"required": []}]
    for case in cases:
        schema = case if draft is None else {"$schema": draft, **case}
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            check_schema(json.dumps(schema))
            refused = False
        except GrammarCompileError:
            refused = True
        assert refused == (not cls(cls.META_SCHEMA).is_valid(schema)), schema
