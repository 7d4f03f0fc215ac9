"""benchmarks/_canonical.py: the rewrite that tells a refusal the guarantee report names from
a silent one puts properties as the grammars write them, and says what it moved."""
from __future__ import annotations

from benchmarks._canonical import SCHEMA_REWRITES, Moves, in_declared_order, with_integral_numbers

SCHEMA = {"$defs": {"point": {"type": "object", "properties": {"x": {}, "y": {}}}},
          "type": "object", "properties": {"name": {}, "at": {"$ref": "#/$defs/point"}},
          "allOf": [{"properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/point"}}}}]}


def test_declared_properties_in_schema_order_through_refs_and_allof():
    moves = Moves()
    value = {"tags": [{"y": 1, "x": 2}], "at": {"y": 0, "x": 0}, "name": "n"}
    ordered = in_declared_order(SCHEMA, value, moves)
    assert list(ordered) == ["name", "at", "tags"]
    assert list(ordered["at"]) == ["x", "y"] and list(ordered["tags"][0]) == ["x", "y"]
    assert moves == Moves(declared=True, undeclared=False)


def test_undeclared_properties_go_last_and_are_recorded():
    moves = Moves()
    ordered = in_declared_order(SCHEMA, {"extra": 1, "name": "n"}, moves)
    assert list(ordered) == ["name", "extra"] and moves == Moves(declared=False, undeclared=True)


def test_a_document_already_in_order_is_unchanged():
    moves = Moves()
    value = {"name": "n", "at": {"x": 1, "y": 2}, "extra": 3}
    assert in_declared_order(SCHEMA, value, moves) == value and moves == Moves()


def test_the_anyof_branch_declaring_most_keys_gives_the_order():
    schema = {"anyOf": [{"properties": {"a": {}}}, {"properties": {"c": {}, "b": {}}}]}
    assert list(in_declared_order(schema, {"b": 1, "c": 2}, Moves())) == ["c", "b"]


def test_integral_floats_become_integers():
    assert with_integral_numbers({"n": [6000.0, 0.5, True, 1]}) == {"n": [6000, 0.5, True, 1]}
    assert type(with_integral_numbers(0.0)) is int


def test_the_branch_of_the_value_s_type_and_discriminator_gives_the_order():
    item = {"type": "object", "properties": {"x": {}, "y": {}}}
    schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": item}]}
    assert list(in_declared_order(schema, [{"y": 1, "x": 2}], Moves())[0]) == ["x", "y"]
    tagged = {"oneOf": [{"properties": {"kind": {"const": "a"}, "p": {}, "q": {}}},
                        {"properties": {"kind": {"const": "b"}, "q": {}, "p": {}}}]}
    assert list(in_declared_order(tagged, {"p": 1, "q": 2, "kind": "b"}, Moves())) == ["kind", "q", "p"]


def test_each_schema_rewrite_removes_its_class_and_keeps_property_names():
    rewrites = {cls: rewrite for cls, *_, rewrite in SCHEMA_REWRITES}
    schema = {"type": "object", "minProperties": 1, "properties": {"minProperties": {"type": "string",
              "format": "uri-reference", "pattern": "^a"}, "o": {"properties": {"a": {}}}},
              "patternProperties": {"^x": {}}}
    assert "minProperties" not in rewrites["min_properties"](schema)
    assert "minProperties" in rewrites["min_properties"](schema)["properties"]
    assert "format" not in rewrites["uri_reference"](schema)["properties"]["minProperties"]
    assert rewrites["untyped"](schema)["properties"]["o"]["type"] == ["object", "array", "string", "number",
                                                                     "boolean", "null"]
    free = rewrites["string_form"](schema)
    assert "pattern" not in free["properties"]["minProperties"]
    assert "patternProperties" not in free and "additionalProperties" not in free, "open: any name, any value"
    closed = rewrites["string_form"]({**schema, "additionalProperties": False})
    assert closed["additionalProperties"] == {"anyOf": [{}]}, "a patterned name is an additional property"
    assert schema["minProperties"] == 1, "the schema itself is left alone"
