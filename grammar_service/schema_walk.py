"""Walking a JSON Schema: every subschema with its JSON pointer (the guarantee report, the
restriction report, the draft and allOf rewrites and llguidance's rewrite all walk alike)."""
from __future__ import annotations

from typing import Iterator

# Keywords whose value is a subschema / a map of subschemas / a list of subschemas.
_ONE = ("additionalProperties", "additionalItems", "items", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems", "contentSchema")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def escape(token: str) -> str:
    """`token` as one RFC 6901 pointer segment."""
    return token.replace("~", "~0").replace("/", "~1")


def iter_subschemas(schema, pointer: str = "") -> Iterator[tuple[str, dict]]:
    """Every schema object under `schema` with its pointer, following schema keywords only
    (never into `const`/`enum`/`default`/`examples` values, never through `$ref`)."""
    if not isinstance(schema, dict):
        return
    yield pointer, schema
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield from iter_subschemas(schema[key], f"{pointer}/{escape(key)}")
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from iter_subschemas(sub, f"{pointer}/{escape(key)}/{escape(name)}")
    for key in _LIST:
        if isinstance(schema.get(key), list):
            for index, sub in enumerate(schema[key]):
                yield from iter_subschemas(sub, f"{pointer}/{key}/{index}")
    if isinstance(schema.get("dependencies"), dict):  # draft 4-7: schema or list of names
        for name, sub in schema["dependencies"].items():
            yield from iter_subschemas(sub, f"{pointer}/dependencies/{escape(name)}")
