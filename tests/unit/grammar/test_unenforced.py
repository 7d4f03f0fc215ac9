"""Unenforced JSON Schema keywords: each is reported with its pointer, refused under strict, and
really not enforced by xgrammar (a violating instance passes the compiled grammar), so this list
stays true when xgrammar changes."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from generation_service.engine.events import UnenforcedKeyword
from generation_service.engine.params import GrammarSpec
from grammar_service.compiler import CompileError

INT_ARRAY = {"type": "array", "items": {"type": "integer"}}
AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
# (keyword, schema placed at /properties/v, an instance of v that violates the keyword)
UNENFORCED = [
    ("not", {"type": "integer", "not": {"const": 3}}, 3),
    ("if", {"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"properties": {"a": {"const": 1}}},
            "then": {"required": ["b"]}}, {"a": 1}),
    ("uniqueItems", {**INT_ARRAY, "uniqueItems": True}, [1, 1]),
    ("contains", {**INT_ARRAY, "contains": {"const": 5}}, [1]),
    ("maxContains", {**INT_ARRAY, "contains": {"const": 5}, "maxContains": 1}, [5, 5]),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, 0.3),
    ("format", {"type": "string", "format": "x-custom"}, "(!! ~"),
    ("format", {"type": "string", "format": "idn-email"}, "(!! ~"),
    ("minLength", {"type": "string", "pattern": "[a-z]+", "minLength": 5}, "ab"),
    ("maxLength", {"type": "string", "format": "email", "maxLength": 5}, "alice@example.com"),
    ("dependentSchemas", {"type": "object", "properties": AB, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    ("dependentRequired", {"type": "object", "properties": AB, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    ("dependencies", {"type": "object", "properties": AB, "dependencies": {"a": ["b"]}}, {"a": 1}),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, {"a": 1}),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, 3),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}, "!!!"),
]
# Keywords that look hard but xgrammar does enforce: never reported, violating instance refused.
ENFORCED = [
    ({"type": "object", "patternProperties": {"^x.*$": {"type": "integer"}}}, {"xa": "s"}),
    ({"type": "object", "propertyNames": {"maxLength": 2}}, {"bbbb": 1}),
    ({"type": "integer", "multipleOf": 3}, 4),
    ({"type": "string", "format": "date"}, "2024-13-45x"),
    ({"type": "string", "minLength": 5}, "ab"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, {"a": 1}),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, True),
]


def _wrap(schema: dict) -> dict:
    return {"type": "object", "properties": {"v": schema}, "required": ["v"]}


def _grammar_accepts(entry, instance) -> bool:
    matcher = xgr.GrammarMatcher(entry.compiled)
    return matcher.accept_string(json.dumps({"v": instance}, separators=(",", ":"))) and matcher.is_completed()


@pytest.mark.parametrize("keyword, schema, violating", UNENFORCED, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(UNENFORCED)])
def test_unenforced_keyword_is_reported_refused_under_strict_and_truly_unenforced(service, keyword, schema, violating):
    text = json.dumps(_wrap(schema))
    entry = service.compile(GrammarSpec("json_schema", text, backend="xgrammar")).result(30).entry
    assert any(u.keyword == keyword and u.pointer == "/properties/v" and u.reason for u in entry.unenforced), entry.unenforced
    assert _grammar_accepts(entry, violating), f"xgrammar now enforces {keyword}: drop it from the list"
    with pytest.raises(CompileError) as info:
        service.compile(GrammarSpec("json_schema", text, strict=True, backend="xgrammar")).result(30)
    assert info.value.status == "INVALID_ARGUMENT"
    assert info.value.message.startswith("strict: the schema uses keywords the grammar cannot enforce: ")
    assert f"{keyword} at /properties/v" in info.value.message


@pytest.mark.parametrize("schema, violating", ENFORCED)
def test_enforced_keywords_are_not_reported(service, schema, violating):
    text = json.dumps(_wrap(schema))
    entry = service.compile(GrammarSpec("json_schema", text, strict=True, backend="xgrammar")).result(30).entry
    assert entry.unenforced == ()
    assert not _grammar_accepts(entry, violating)


def test_pointers_are_rfc6901_and_nested(service):
    schema = {"type": "object", "properties": {"a/b~c": {"type": "array", "items": {"not": {"type": "null"}}}},
              "$defs": {"t": {"type": "array", "uniqueItems": True}}}
    entry = service.compile(GrammarSpec("json_schema", json.dumps(schema), backend="xgrammar")).result(30).entry
    assert set(entry.unenforced) == {
        UnenforcedKeyword("not", "/properties/a~1b~0c/items", "the grammar cannot exclude what a subschema matches"),
        UnenforcedKeyword("uniqueItems", "/$defs/t", "the grammar cannot compare array items with each other")}
