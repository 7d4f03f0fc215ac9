"""Each constraint kind through a real server; every output is checked independently."""
import json
import re

import jsonschema
import lark
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def test_json_schema_output_validates_and_reports_its_guarantee(client):
    chunks = list(client.generate("A person:", json_schema=PERSON, compact=True, max_tokens=64))
    assert chunks[0].guarantee is not None and not chunks[0].token_ids, \
        "the guarantee report comes before the first token"
    assert chunks[0].guarantee.backend and chunks[0].guarantee.is_fully_enforced
    # the grammar writes the properties in the listed order: said, not silent
    assert ("properties", "") in {(r.keyword, r.pointer) for r in chunks[0].guarantee.restricted}
    final = chunks[-1]
    text = "".join(c.text for c in chunks)
    assert final.finish_reason == "grammar_complete", text
    jsonschema.validate(json.loads(text), PERSON)
    assert final.validation is not None and final.validation.valid


def test_json_schema_with_unenforced_keyword_is_reported_then_validated(client):
    schema = {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2, "uniqueItems": True}
    completion = client.generate_text("Numbers:", json_schema=schema, compact=True, max_tokens=32)
    assert [(k.keyword, k.pointer) for k in completion.guarantee.unenforced] == [("uniqueItems", "")]
    value = json.loads(completion.text)
    is_unique = len(set(value)) == len(value)
    assert completion.validation.valid == is_unique  # the server checks the keyword it could not enforce
    if not is_unique:
        assert completion.validation.errors


def test_a_fallback_of_auto_is_in_the_guarantee_report(client):
    """500 optional properties: llguidance compiles them but cannot take the first token, so
    `auto` serves the schema with xgrammar and the report says it fell back from its pick."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}
    completion = client.generate_text("An object:", json_schema=schema, compact=True, max_tokens=32)
    assert (completion.guarantee.backend, completion.guarantee.fallback_from) == ("xgrammar", "llguidance")
    jsonschema.validate(json.loads(completion.text), schema)
    plain = client.generate_text("A person:", json_schema=PERSON, compact=True, max_tokens=64)
    assert plain.guarantee.fallback_from == ""


def test_second_identical_schema_is_a_cache_hit(client):
    schema = {"enum": ["left", "right"]}
    client.generate_text("Go", json_schema=schema, max_tokens=8)
    again = client.generate_text("Go", json_schema=schema, max_tokens=8)
    assert again.guarantee.cache_hit and again.text in ('"left"', '"right"')


@pytest.mark.parametrize("pattern", [r"[a-z]{3}-[0-9]{2}", r"(yes|no), because [a-z]{1,8}\."])
def test_regex_output_fullmatches(client, pattern):
    completion = client.generate_text("Code:", regex=pattern, max_tokens=32)
    assert completion.finish_reason == "grammar_complete"
    assert re.fullmatch(pattern, completion.text), completion.text


def test_choice_output_is_one_of_the_choices(client):
    choices = ["red", "green", "blue", "dark blue"]
    completion = client.generate_text("Color:", choices=choices, max_tokens=16)
    assert completion.text in choices and completion.finish_reason == "grammar_complete"


def test_lark_output_parses_with_the_same_grammar(client):
    grammar = '''
start: greeting " " name ("!" | ".")
greeting: "hello" | "hi" | "good morning"
name: "world" | "there" | NUMBER
NUMBER: /[0-9]{1,3}/
'''
    completion = client.generate_text("Greet:", lark=grammar, max_tokens=24)
    assert completion.finish_reason == "grammar_complete"
    lark.Lark(grammar, start="start").parse(completion.text)


def test_json_object_output_is_an_object(client):
    completion = client.generate_text("Object:", json_object=True, compact=True, max_tokens=48,
                                      temperature=1.0, seed=3)
    # the model rambles inside strings at temperature 1.0: the grammar closes the object on budget
    assert completion.finish_reason in ("grammar_complete", "budget_closed"), completion.text
    assert isinstance(json.loads(completion.text), dict)


def test_structural_tag_output_has_the_tag_around_valid_content(client):
    tag = {"type": "structural_tag",
           "format": {"type": "tag", "begin": "<answer>", "end": "</answer>",
                      "content": {"type": "regex", "pattern": "[0-9]{2}"}}}
    completion = client.generate_text("Q:", structural_tag=tag, max_tokens=24)
    assert completion.finish_reason == "grammar_complete"
    assert re.fullmatch(r"<answer>[0-9]{2}</answer>", completion.text), completion.text


def test_max_whitespace_caps_whitespace_runs(client):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}
    completion = client.generate_text("List:", json_schema=schema, max_whitespace=1, max_tokens=48)
    assert not re.search(r"\s{2,}", completion.text), repr(completion.text)
    assert completion.finish_reason in ("grammar_complete", "budget_closed")
    jsonschema.validate(json.loads(completion.text), schema)


def test_strict_accepts_a_fully_enforceable_schema(client):
    completion = client.generate_text("Flag:", json_schema={"type": "boolean"}, strict=True, max_tokens=8)
    assert completion.text in ("true", "false") and completion.guarantee.is_fully_enforced
