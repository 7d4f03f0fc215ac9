"""llguidance compiles schemas its resolver or its regex engine refused: a draft spelled with
https, a URI of no draft, a definition name with a space or angle brackets under an `$id`, a
look-around in a `pattern` (grammar_service/backends/llguidance_schema.py). Each such schema
had only xgrammar to compile it, in seconds for some of the corpus's."""
from __future__ import annotations

import json
import re

import pytest

from documents import accepts
from grammar_contract.spec import GrammarSpec
from grammar_service.auto_choice import choose_backend
from grammar_service.backends.llguidance_schema import for_llguidance
from grammar_service.excluded_names import without_exclusion
from grammar_service.look_around import without_look_around
from grammar_service.restrictions import json_restrictions

NAMED = {"$id": "https://example.com/pipeline", "type": "object", "required": ["node"],
         "$defs": {"Parameter Node": {"type": "integer"}, "Top<Spec>": {"type": "string"}},
         "properties": {"node": {"$ref": "#/$defs/Parameter Node"}, "top": {"$ref": "#/$defs/Top<Spec>"}}}
DRAFT_7_HTTPS = {"$schema": "https://json-schema.org/draft-07/schema#", "type": "object", "required": ["a"],
                 "properties": {"a": {"type": "integer"}}}
NO_DRAFT = {**DRAFT_7_HTTPS, "$schema": "http://json-schema.org/schema#"}
NESTED = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "required": ["a"],
          "properties": {"a": {"$schema": "https://json-schema.org/draft-07/schema", "type": "integer"}}}
UNREADABLE = {"named refs": NAMED, "https draft": DRAFT_7_HTTPS, "no draft": NO_DRAFT, "nested": NESTED}


@pytest.mark.parametrize("schema", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_llguidance_compiles_and_enforces_what_its_resolver_refused(make_backend, tokenize, schema):
    llguidance = make_backend("llguidance")
    valid, invalid = ({"node": 3, "top": "x"}, {"node": "3"}) if schema is NAMED else ({"a": 1}, {"a": "1"})
    assert accepts(llguidance, schema, valid, tokenize)
    assert not accepts(llguidance, schema, invalid, tokenize)
    choice = choose_backend(GrammarSpec("json_schema", json.dumps(schema)), make_backend)
    assert "llguidance" in (choice.backend, choice.fast_fallback), choice.reason


def test_the_rewrite_spells_drafts_as_the_registry_and_encodes_names_only():
    assert json.loads(for_llguidance(json.dumps(DRAFT_7_HTTPS)))["$schema"] == "http://json-schema.org/draft-07/schema#"
    modern = {"$schema": "http://json-schema.org/draft/2020-12/schema#", "type": "string"}
    assert json.loads(for_llguidance(json.dumps(modern)))["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert "$schema" not in json.loads(for_llguidance(json.dumps(NO_DRAFT)))
    assert "$schema" in json.loads(for_llguidance(json.dumps(NESTED)))["properties"]["a"]
    properties = json.loads(for_llguidance(json.dumps(NAMED)))["properties"]
    assert properties == {"node": {"$ref": "#/$defs/Parameter%20Node"}, "top": {"$ref": "#/$defs/Top%3CSpec%3E"}}
    plain = json.dumps({"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/a%20b",
                        "definitions": {"a b": {"const": {"$ref": "#/not a schema"}}}})
    assert for_llguidance(plain) is plain, "registered drafts, encoded references and data stay as they are"


@pytest.mark.parametrize("pattern,kept", [
    ("^(?!^lucene\\.|builtin\\.).*", "^.*"),
    ("^(?!-)[-a-z0-9]{0,49}[a-z0-9]$", "^[-a-z0-9]{0,49}[a-z0-9]$"),
    ("(?<=^v?|\\sv?)(?:0|[1-9])", "(?:0|[1-9])"),
    ("^((?!message|severity).)*$", "^(.)*$"),
    ("^[(?!]a(?=[)]b)", "^[(?!]a"),       # inside a class it is text; a class may hold ")"
    ("a\\(?!b", "a\\(?!b"),                # an escaped parenthesis opens no group
    ("^(?!a)*b", "^(?!a)*b"),              # a quantified assertion: left for the compile to refuse
])
def test_look_around_is_dropped_and_nothing_else(pattern, kept):
    assert without_look_around(pattern) == kept


def test_a_look_around_in_a_property_name_pattern_stays(make_backend):
    """Dropped there, the name would match declared properties, which would then have to
    match the pattern's schema too: valid documents refused. llguidance refuses the schema."""
    schema = {"type": "object", "properties": {"python": {"type": "string"}},
              "patternProperties": {"^(?=[a-z])(?!python$)\\w+$": {"type": "integer"}}}
    assert "(?!python$)" in for_llguidance(json.dumps(schema))
    choice = choose_backend(GrammarSpec("json_schema", json.dumps(schema)), make_backend)
    assert choice.backend == "xgrammar" and "llguidance" not in choice.fallbacks


def test_a_name_patterns_look_around_that_excludes_no_declared_name_is_dropped(make_backend, tokenize):
    """snapcraft's parts: `^(?!plugins$)...` beside additionalProperties false. llguidance takes
    it without the assertion, and the report names what that lets through."""
    schema = {"type": "object", "additionalProperties": False,
              "patternProperties": {"^(?!plugins$)[a-z0-9][a-z0-9+-]*$": {"type": "integer"}}}
    llguidance = make_backend("llguidance")
    assert "(?!" not in for_llguidance(json.dumps(schema))
    assert accepts(llguidance, schema, {"part-1": 3}, tokenize)
    assert not accepts(llguidance, schema, {"part-1": "x"}, tokenize)
    assert accepts(llguidance, schema, {"plugins": 3}, tokenize)  # the weakening the report names
    unenforced = llguidance.unenforced_keywords(GrammarSpec("json_schema", json.dumps(schema)))
    assert [(u.keyword, u.pointer) for u in unenforced] == [("patternProperties", "")]
    choice = choose_backend(GrammarSpec("json_schema", json.dumps(schema)), make_backend)
    assert "llguidance" in (choice.backend, choice.fast_fallback), choice.reason


def test_where_additional_properties_are_free_the_dropped_look_around_is_a_named_restriction(make_backend, tokenize):
    """Hugo's taxonomies: the names the assertion excluded now take the pattern's schema."""
    schema = {"type": "object", "patternProperties": {"^(?!.*--)[a-z-]+$": {"type": "integer"}}}
    llguidance = make_backend("llguidance")
    assert accepts(llguidance, schema, {"ab": 1}, tokenize)
    assert not accepts(llguidance, schema, {"a--b": "free"}, tokenize)  # valid, refused: named below
    assert not llguidance.unenforced_keywords(GrammarSpec("json_schema", json.dumps(schema)))
    restricted = json_restrictions(json.dumps(schema), "llguidance")
    assert any(r.keyword == "patternProperties" and "look-around" in r.reason for r in restricted)
    assert not any("look-around" in r.reason for r in json_restrictions(json.dumps(schema), "xgrammar"))


def test_a_look_around_in_a_non_standard_definitions_folder_is_rewritten_too():
    """vega keeps subschemas in `defs`, reached only through $ref: the walk follows them."""
    schema = {"$ref": "#/defs/name", "defs": {"name": {"type": "string", "pattern": "^(?!a)b"}}}
    assert json.loads(for_llguidance(json.dumps(schema)))["defs"]["name"]["pattern"] == "^b"


@pytest.mark.parametrize("pattern,names,others", [
    (r"^(?!python$)[a-zA-Z-_.0-9]+$", ["python"], ["pythons", "pytho", "requests", "Python"]),
    (r"^(?!interactive|name|style).+$", ["name", "names", "style-x", "interactive"], ["nam", "x-name", "stylo", "i"]),
    (r"^(?!get-user|get-users)([a-z0-9-]+)$", ["get-user", "get-users", "get-user-x"], ["get-use", "get-usr", "x"]),
])
def test_a_look_ahead_over_listed_words_is_spelled_without_it_for_the_same_names(pattern, names, others):
    spelled = without_exclusion(pattern)
    assert spelled is not None and "(?!" not in spelled and "(?=" not in spelled
    for name in names:
        assert not re.search(spelled, name), name
    for name in others:
        assert bool(re.search(spelled, name)) == bool(re.search(pattern, name)), name


def test_every_other_property_keeps_its_meaning_under_llguidance(make_backend, tokenize):
    """pyproject's dependencies: `python` is declared, every other name takes the pattern."""
    schema = {"type": "object", "properties": {"python": {"type": "string"}},
              "patternProperties": {"^(?!python$)[a-z]+$": {"type": "integer"}}, "additionalProperties": False}
    llguidance = make_backend("llguidance")
    assert accepts(llguidance, schema, {"python": "3.11", "requests": 2}, tokenize)
    assert not accepts(llguidance, schema, {"python": 3}, tokenize)
    assert not accepts(llguidance, schema, {"requests": "2"}, tokenize)
    assert not llguidance.unenforced_keywords(GrammarSpec("json_schema", json.dumps(schema)))


def test_a_name_pattern_covered_by_an_equal_match_all_pattern_goes(make_backend, tokenize):
    """Chrome Extension's commands: ".*" and "^_execute_browser_action$", the same schema."""
    command = {"type": "object", "properties": {"key": {"type": "string"}}, "additionalProperties": False}
    schema = {"type": "object", "patternProperties": {".*": command, "^_execute_browser_action$": command,
                                                      "^other$": {"type": "integer"}}}
    rewritten = json.loads(for_llguidance(json.dumps(schema)))["patternProperties"]
    assert list(rewritten) == [".*", "^other$"]  # a pattern with another schema stays (llguidance refuses it)
    single = {"type": "object", "patternProperties": {".*": command, "^_execute_browser_action$": command}}
    llguidance = make_backend("llguidance")
    assert accepts(llguidance, single, {"_execute_browser_action": {"key": "Ctrl+B"}, "x": {}}, tokenize)
    assert not accepts(llguidance, single, {"_execute_browser_action": {"key": 1}}, tokenize)
