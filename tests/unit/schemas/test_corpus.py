"""The real-world corpus: enough schemas, all shipped by installed packages, all self-contained."""
from __future__ import annotations

import importlib.metadata

import jsonschema

from benchmarks.corpus import load_corpus
from grammar_service.schema_walk import iter_subschemas


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


def test_the_wide_corpus_adds_schemastores_catalog_each_text_once():
    from benchmarks.corpus import load_wide_corpus

    wide = load_wide_corpus()
    assert len(wide) >= 500 and len({s.text for s in wide}) == len(wide) == len({s.name for s in wide})
    assert {s.name for s in load_corpus()} <= {s.name for s in wide}


def test_benchmark_instances_are_what_the_validator_says():
    """Valid ones validate (the key-order and undeclared-first variants included), mutated ones do not."""
    import json

    from benchmarks._instances import make_instances
    from structgen.schema_validation import validate_output

    schema = json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "size": {"type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}, "required": ["name", "size"],
        "examples": [{"name": "box", "size": 3, "tags": ["a"]}, {"name": 5}]})
    instances, error = make_instances(schema, num_generated=4, num_invalid=4, seed=0)
    assert error == ""
    kinds = {i.kind for i in instances}
    assert {"example", "generated", "reordered", "undeclared_first", "mutated"} <= kinds
    assert [i.text for i in instances if i.kind == "example"] == ['{"name": "box", "size": 3, "tags": ["a"]}']
    for instance in instances:
        assert validate_output(schema, instance.text).valid == instance.is_valid, instance
