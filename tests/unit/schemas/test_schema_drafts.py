"""A schema means what its draft says: drafts 4-7 ignore the keywords beside `$ref`, so the
grammar takes the documents those drafts call valid (the final validation reads the same
`$schema`), and llguidance compiles circular references that had such siblings."""
from __future__ import annotations

import json

import pytest

from benchmarks.corpus import get_schema
from documents import accepts
from grammar_contract.spec import GrammarSpec
from grammar_service.schema_drafts import as_drafted
from structgen.schema_validation import validate_output

D4, D7 = "http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-07/schema#"
D2020 = "https://json-schema.org/draft/2020-12/schema"


def _ref_with_type(draft: str) -> dict:
    return {"$schema": draft, "type": "object", "definitions": {"s": {"type": "string"}},
            "properties": {"a": {"$ref": "#/definitions/s", "type": "integer"}}}


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("draft", [D4, D7])
def test_a_document_valid_under_an_old_draft_is_taken(make_backend, tokenize, backend_name, draft):
    schema, document = _ref_with_type(draft), {"a": "text"}
    assert validate_output(json.dumps(schema), json.dumps(document)).valid, "the draft ignores `type` beside $ref"
    backend = make_backend(backend_name)
    assert accepts(backend, schema, document, tokenize)
    assert backend.unenforced_keywords(GrammarSpec("json_schema", json.dumps(schema))) == (), \
        "nothing the draft asserts is left out"


def test_siblings_of_ref_apply_from_2019_09_on(make_backend, tokenize):
    schema = _ref_with_type(D2020)
    assert as_drafted(json.dumps(schema)) == json.dumps(schema)
    assert not validate_output(json.dumps(schema), '{"a":"text"}').valid
    assert not accepts(make_backend("llguidance"), schema, {"a": "text"}, tokenize)


def test_only_schema_keywords_are_rewritten():
    """Definitions stay (pointers resolve into them); a `$ref` inside data is data."""
    schema = {"$schema": D7, "$id": "urn:x", "$ref": "#/definitions/o", "title": "t",
              "definitions": {"o": {"type": "object", "const": {"$ref": "#/x", "keep": 1},
                                    "properties": {"p": {"$ref": "#/definitions/o", "minProperties": 1}}}}}
    assert json.loads(as_drafted(json.dumps(schema))) == {
        "$schema": D7, "$id": "urn:x", "$ref": "#/definitions/o",
        "definitions": {"o": {"type": "object", "const": {"$ref": "#/x", "keep": 1},
                              "properties": {"p": {"$ref": "#/definitions/o"}}}}}


def test_llguidance_compiles_a_draft_07_schema_with_circular_references_and_siblings(make_backend):
    """circle-ci (draft-07) has `$ref`s with siblings inside a cycle; llguidance refused it."""
    backend = make_backend("llguidance")
    spec = GrammarSpec("json_schema", get_schema("circle-ci").text)
    assert backend.compile(spec).lanes
