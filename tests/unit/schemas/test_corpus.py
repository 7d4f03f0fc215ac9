"""The real-world corpus: enough schemas, all shipped by installed packages, all self-contained."""
from __future__ import annotations

import importlib.metadata

import jsonschema

from benchmarks.corpus import load_corpus
from grammar_service.guarantees import iter_subschemas


def test_at_least_twenty_real_schemas_from_installed_packages():
    corpus = load_corpus()
    assert len(corpus) >= 20 and len({s.name for s in corpus}) == len(corpus)
    for schema in corpus:
        assert importlib.metadata.distribution(schema.package).locate_file(schema.path).is_file()


def test_every_ref_resolves_inside_the_bundled_document():
    for schema in load_corpus():
        document = schema.schema
        resolver = jsonschema.validators.validator_for(document)(document)
        for _, subschema in iter_subschemas(document):
            ref = subschema.get("$ref")
            if isinstance(ref, str):
                assert ref.startswith("#"), (schema.name, ref)
                resolver._resolver.lookup(ref)  # raises on a dangling ref
