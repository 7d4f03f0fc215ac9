"""Unenforced JSON Schema keywords: each is reported with its pointer, refused under strict, and
really not enforced by xgrammar (a violating instance passes the compiled grammar), so this list
stays true when xgrammar changes."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from grammar_contract.report import UnenforcedKeyword
from grammar_contract.spec import GrammarSpec
from grammar_service.compiler import CompileError
from structgen.schema_validation import validate_output

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
    # branches beside `$ref` do not fold into one object (grammar_service/allof_merge.py)
    ("allOf", {"allOf": [{"$ref": "#/$defs/o", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"$ref": "#/$defs/o", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, {"a": 1}),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, 3),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}, "!!!"),
    # keywords beside $ref are dropped (the reference alone is compiled)
    ("maxLength", {"$ref": "#/$defs/s", "maxLength": 2}, "abc"),
    ("minimum", {"$ref": "#/$defs/i", "minimum": 5}, 1),
    ("required", {"$ref": "#/$defs/o", "required": ["a"]}, {}),
    # look-ahead in pattern is ignored
    ("pattern", {"type": "string", "pattern": "^(?!abc)[a-z]+$"}, "abcd"),
    # beside anyOf/oneOf/allOf only the branches are compiled: the parent's type and other
    # assertions are dropped
    ("type", {"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, 5),
    ("type", {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}, 5),
    ("type", {"type": "string", "anyOf": [{"type": "string", "maxLength": 3}, {"enum": [1, 2]}]}, 1),
    ("properties", {"type": "object", "properties": {"a": {"type": "integer"}},
                    "anyOf": [{"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]}, {"a": "x"}),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                  "anyOf": [{"type": "object", "required": ["b"]}, {"type": "object", "required": ["c"]}]}, {"b": 1}),
    ("minimum", {"type": "integer", "minimum": 5,
                 "anyOf": [{"type": "integer", "maximum": 100}, {"type": "integer", "multipleOf": 2}]}, 1),
    ("maxLength", {"type": "string", "maxLength": 2, "allOf": [{"type": "string", "maxLength": 10}]}, "abcd"),
    # pattern beside an enforced format is dropped (citation-file-format's license-url)
    ("pattern", {"type": "string", "format": "uri", "pattern": "^(https|http)://.+"}, "mailto:a"),
    ("pattern", {"type": "string", "format": "date", "pattern": "^19"}, "2024-01-02"),
    # beside properties, pattern-matched keys take additional properties' values (pyproject-distutils)
    ("patternProperties", {"type": "object", "properties": {"g": {"type": "object"}},
                           "patternProperties": {".+": {"type": "object"}}}, {"a": 1}),
    ("patternProperties", {"type": "object", "properties": {"g": {"type": "object"}},
                           "patternProperties": {"^x": {"type": "object"}},
                           "additionalProperties": {"type": "integer"}}, {"x": 1}),
    # ... and declared properties take them too
    ("properties", {"type": "object", "properties": {"a": {"type": "integer"}},
                    "patternProperties": {"^x": {"type": "string"}}}, {"a": "text"}),
    # beside enum/const only the listed values are compiled: a sibling a listed value breaks is dropped
    ("type", {"enum": ["a", "b"], "type": "object"}, "a"),
    ("maximum", {"enum": [1, 10], "maximum": 5}, 10),
    ("required", {"const": {}, "required": ["a"]}, {}),
    # without `type` (and nothing to infer an object or array from) any JSON value is compiled
    ("pattern", {"pattern": "^a"}, "zzz"),
    ("minimum", {"minimum": 5}, 1),
    ("minItems", {"minItems": 2}, [1]),
    ("required", {"required": ["a"]}, {}),
    # a required name that `properties` does not declare is not required
    ("required", {"type": "object", "required": ["a"]}, {}),
    ("required", {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["a", "b"]}, {"b": 1}),
]
# reported, though a 2020-12 validator does not assert them either (annotations, an unknown
# format, draft 7's `dependencies`)
REPORTED_BEYOND_THE_VALIDATOR = {"contentEncoding", "format", "dependencies"}
DEFS = {"s": {"type": "string"}, "i": {"type": "integer"}, "o": {"type": "object"}}
# (keyword, schema at /properties/v, raw JSON of v that is not JSON): length-limited strings
CONTROL_CHARACTERS = [("maxLength", {"type": "string", "maxLength": 5}, '"a\x01b"'),
                      ("minLength", {"type": "string", "minLength": 1}, '"a\tb"')]
# Keywords that look hard but xgrammar does enforce: never reported, violating instance refused.
ENFORCED = [
    ({"type": "object", "patternProperties": {"^x.*$": {"type": "integer"}}}, {"xa": "s"}),
    ({"type": "object", "properties": {"g": {"type": "object"}}, "patternProperties": {"^x": {"type": "object"}},
      "additionalProperties": False}, {"x": 1}),
    # (propertyNames' maxLength is enforced too, but names under it admit raw control characters)
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]{1,2}$"}}, {"bbbb": 1}),
    ({"type": "integer", "multipleOf": 3}, 4),
    # without `type`, properties make an object and items an array, whose keywords hold
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {}),
    ({"items": {"type": "integer"}, "maxItems": 1}, [1, 2]),
    ({"type": "string", "format": "date"}, "2024-13-45x"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, {"a": 1}),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, True),
    # properties split across allOf branches, folded into one object before the compile
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, {"a": 1}),
    # enum beside anyOf, and a parent type every branch repeats, stay enforced
    ({"enum": ["a", "b"], "anyOf": [{"type": "string"}, {"type": "integer"}]}, "zzz"),
    ({"type": "object", "anyOf": [{"type": "object", "properties": {"a": {}}, "required": ["a"]},
                                  {"type": "object", "properties": {"b": {}}, "required": ["b"]}]}, 5),
    # siblings of enum that every listed value keeps are in effect
    ({"enum": ["a", "b"], "type": "string"}, 1),
    # strings without length limits never admit raw control characters (checked below)
    ({"type": "string", "pattern": "^[a-z]+$"}, "abc1"),
]


def _wrap(schema: dict) -> dict:
    return {"type": "object", "properties": {"v": schema}, "required": ["v"], "$defs": DEFS}


def _grammar_accepts(entry, instance, raw: str | None = None) -> bool:
    matcher = xgr.GrammarMatcher(entry.compiled)
    text = '{"v":' + raw + "}" if raw is not None else json.dumps({"v": instance}, separators=(",", ":"))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("keyword, schema, violating", UNENFORCED, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(UNENFORCED)])
def test_unenforced_keyword_is_reported_refused_under_strict_and_truly_unenforced(service, keyword, schema, violating):
    text = json.dumps(_wrap(schema))
    entry = service.compile(GrammarSpec("json_schema", text, backend="xgrammar")).result(30).entry
    assert any(u.keyword == keyword and u.pointer == "/properties/v" and u.reason for u in entry.unenforced), entry.unenforced
    assert _grammar_accepts(entry, violating), f"xgrammar now enforces {keyword}: drop it from the list"
    if keyword not in REPORTED_BEYOND_THE_VALIDATOR:
        assert not validate_output(text, json.dumps({"v": violating})).valid, "the schema refuses the instance"
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


@pytest.mark.parametrize("keyword, schema, raw", CONTROL_CHARACTERS)
def test_length_limited_strings_admit_raw_control_characters_and_say_so(service, keyword, schema, raw):
    raw = raw.encode().decode("unicode_escape")  # a real control character inside the string
    entry = service.compile(GrammarSpec("json_schema", json.dumps(_wrap(schema)), backend="xgrammar")).result(30).entry
    assert any(u.keyword == keyword and u.pointer == "/properties/v" and "control" in u.reason
               for u in entry.unenforced), entry.unenforced
    assert _grammar_accepts(entry, None, raw), "xgrammar now refuses raw control characters: drop the rule"
    plain = service.compile(GrammarSpec("json_schema", json.dumps(_wrap({"type": "string"})),
                                        backend="xgrammar")).result(30).entry
    assert not _grammar_accepts(plain, None, raw)


def test_objects_are_as_open_as_the_schema_says(service):
    """strict_mode=False: no additionalProperties means open (xgrammar's default closed them)."""
    schema = _wrap({"type": "object", "properties": {"a": {"type": "integer"}}})
    entry = service.compile(GrammarSpec("json_schema", json.dumps(schema), backend="xgrammar")).result(30).entry
    assert _grammar_accepts(entry, {"a": 1, "b": [2]}) and not _grammar_accepts(entry, {"a": "x"})
    closed = _wrap({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False})
    entry = service.compile(GrammarSpec("json_schema", json.dumps(closed), backend="xgrammar")).result(30).entry
    assert not _grammar_accepts(entry, {"a": 1, "b": [2]})


def test_keywords_beside_ref_are_reported_but_the_definitions_are_walked(service):
    schema = {"$ref": "#/$defs/t", "maxLength": 2, "$defs": {"t": {"type": "array", "uniqueItems": True}}}
    entry = service.compile(GrammarSpec("json_schema", json.dumps(schema), backend="xgrammar")).result(30).entry
    assert {(u.keyword, u.pointer) for u in entry.unenforced} == {("maxLength", ""), ("uniqueItems", "/$defs/t")}
