"""validate_output: the full schema, checked with jsonschema, draft from $schema, paths of failures."""
from __future__ import annotations

import json

import jsonschema
import pytest

from benchmarks.corpus import get_schema
from structgen.schema_validation import MAX_ERRORS, unexplained_violations, validate_output, violations

DRAFT4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "maximum": 3,
          "exclusiveMaximum": True}
DRAFT2020 = {"type": "number", "exclusiveMaximum": 3}


def test_valid_output():
    result = validate_output(json.dumps({"type": "object", "required": ["a"]}), '{"a": 1}')
    assert result.valid and result.errors == () and result.num_errors == 0


def test_failures_carry_the_output_path_and_the_schema_keyword():
    schema = {"type": "object", "properties": {"jobs": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}}}, "uniqueItems": True}}}
    result = validate_output(json.dumps(schema), '{"jobs": [{"id": "x"}, {"id": "x"}]}')
    assert not result.valid and result.num_errors == 3
    paths = {(i.path, i.schema_pointer) for i in result.issues}
    assert ("/jobs", "/properties/jobs/uniqueItems") in paths
    assert ("/jobs/0/id", "/properties/jobs/items/properties/id/type") in paths
    assert "/jobs/1/id: 'x' is not of type 'integer'" in result.errors[-1]


@pytest.mark.parametrize("schema,valid", [(DRAFT4, False), (DRAFT2020, False),
                                          ({**DRAFT4, "exclusiveMaximum": False}, True)])
def test_draft_comes_from_dollar_schema(schema, valid):
    assert validate_output(json.dumps(schema), "3").valid is valid


@pytest.mark.parametrize("uri", ["http://json-schema.org/draft-07/schema#", "https://json-schema.org/draft-07/schema#",
                                 "https://json-schema.org/draft-07/schema", " http://json-schema.org/draft-07/schema "])
def test_the_draft_is_read_however_its_uri_is_spelled(uri):
    # `dependencies` is draft 7's keyword (2020-12 ignores it): {"a": 1} lacks the "b" it requires
    schema = json.dumps({"$schema": uri, "type": "object", "dependencies": {"a": ["b"]}})
    assert not validate_output(schema, '{"a": 1}').valid
    assert validate_output(schema, '{"a": 1, "b": 2}').valid


def test_formats_are_checked():
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                               "site": {"type": "string", "format": "uri"}}}
    result = validate_output(json.dumps(schema), '{"when": "yesterday", "site": "not a uri"}')
    assert {i.schema_pointer for i in result.issues} == {"/properties/when/format", "/properties/site/format"}


def test_ecma_patterns_python_re_lacks_are_still_checked():
    schema = json.dumps({"type": "string", "pattern": "^\\p{Lu}"})
    assert validate_output(schema, '"Élan"').valid and not validate_output(schema, '"élan"').valid


def test_output_that_is_not_json():
    result = validate_output('{"type": "object"}', '{"a": ')
    assert not result.valid and result.issues[0].path == "" and "not valid JSON" in result.errors[0]


def test_a_schema_jsonschema_cannot_use_is_said_so():
    result = validate_output('{"type": 12}', '"x"')
    assert not result.valid and "cannot validate with jsonschema" in result.errors[0]


def test_errors_are_capped_but_counted():
    schema = json.dumps({"type": "array", "items": {"type": "string"}})
    result = validate_output(schema, json.dumps(list(range(MAX_ERRORS + 7))))
    assert len(result.issues) == MAX_ERRORS and result.num_errors == MAX_ERRORS + 7


def test_same_violations_as_jsonschema_on_a_real_schema():
    text = get_schema("github-issue-config").text
    doc = {"blank_issues_enabled": "yes", "contact_links": [{"name": "", "url": "ftp://x"}], "extra": 1}
    cls = jsonschema.validators.validator_for(json.loads(text))
    expected = sorted(("".join(f"/{p}" for p in e.absolute_path), e.message)
                      for e in cls(json.loads(text)).iter_errors(doc))
    assert sorted((i.path, i.message) for i in violations(text, doc)) == expected and len(expected) >= 4


def test_unexplained_violations_look_beneath_oneof():
    schema = json.dumps({"oneOf": [
        {"type": "object", "propertyNames": {"maxLength": 2}},
        {"type": "array"}]})
    output = '{"toolong": 1}'  # no branch matches, because of propertyNames beneath oneOf
    assert unexplained_violations(schema, output, {"propertyNames"}) == []
    assert unexplained_violations(schema, output, {"uniqueItems"}) == ["/oneOf"]
    assert unexplained_violations(schema, "[1, ", {"oneOf"}) == ["(not JSON)"]


def test_raw_control_characters_are_explained_only_by_a_reported_length_limit():
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}})
    output = '{"a": "x\x01y"}'  # not JSON: a raw control character inside a string
    assert not validate_output(schema, output).valid
    assert unexplained_violations(schema, output, set()) == ["(not JSON)"]
    assert unexplained_violations(schema, output, {"maxLength"}) == []
    assert unexplained_violations(schema, '{"a": ', {"maxLength"}) == ["(not JSON)"]


def test_a_document_cut_by_max_tokens_is_truncated_and_says_so():
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}})
    cut = validate_output(schema, '{"name": "Ev', cut_by_max_tokens=True)
    assert not cut.valid and cut.truncated and "max_tokens cut the document short" in cut.issues[0].message
    stopped = validate_output(schema, '{"name": "Ev')  # ended otherwise (a stop string): not JSON
    assert not stopped.truncated and "not valid JSON" in stopped.issues[0].message
    whole = validate_output(schema, '{"name": "Eve"}', cut_by_max_tokens=True)  # complete at the limit
    assert whole.valid and not whole.truncated
