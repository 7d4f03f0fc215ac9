"""llguidance compiles schemas whose `$schema` or local `$ref`s its resolver did not take: a
draft spelled with https, a URI of no draft, a definition name with a space or angle brackets
under an `$id` (grammar_service/backends/llguidance_schema.py). Each such schema had only
xgrammar to compile it, in seconds for some of the corpus's."""
from __future__ import annotations

import json

import pytest

from documents import accepts
from grammar_contract.spec import GrammarSpec
from grammar_service.auto_choice import choose_backend
from grammar_service.backends.llguidance_schema import for_llguidance

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
