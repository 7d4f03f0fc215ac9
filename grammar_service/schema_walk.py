"""Walking a JSON Schema: every subschema with its JSON pointer (the guarantee report, the
restriction report, the draft and allOf rewrites and llguidance's rewrite all walk alike)."""
from __future__ import annotations

from typing import Iterator
from urllib.parse import unquote

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
    (never into `const`/`enum`/`default`/`examples` values), then, from the root, the targets of
    local `$ref`s that no keyword reaches (a non-standard `defs` a reference names), each once."""
    walked: set[str] = set()
    refs: list[str] = []
    yield from _walk(schema, pointer, walked, refs)
    while refs and pointer == "":
        target = _pointer_of(refs.pop())
        if target is None or target in walked:
            continue
        node = resolve_pointer(schema, target)
        if isinstance(node, dict):
            yield from _walk(node, target, walked, refs)


def _walk(schema, pointer: str, walked: set[str], refs: list[str]) -> Iterator[tuple[str, dict]]:
    if not isinstance(schema, dict) or pointer in walked:
        return
    walked.add(pointer)
    if isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#"):
        refs.append(schema["$ref"])
    yield pointer, schema
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield from _walk(schema[key], f"{pointer}/{escape(key)}", walked, refs)
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from _walk(sub, f"{pointer}/{escape(key)}/{escape(name)}", walked, refs)
    for key in _LIST:
        if isinstance(schema.get(key), list):
            for index, sub in enumerate(schema[key]):
                yield from _walk(sub, f"{pointer}/{key}/{index}", walked, refs)
    if isinstance(schema.get("dependencies"), dict):  # draft 4-7: schema or list of names
        for name, sub in schema["dependencies"].items():
            yield from _walk(sub, f"{pointer}/dependencies/{escape(name)}", walked, refs)


def _pointer_of(ref: str) -> str | None:
    """The JSON pointer of a local reference ("#/defs/a%20b" -> "/defs/a b"); None for an anchor."""
    fragment = unquote(ref[1:])
    return fragment if fragment == "" or fragment.startswith("/") else None


def resolve_pointer(schema, pointer: str):
    """The value at an RFC 6901 pointer ("/defs/a~1b"); None where nothing is."""
    node = schema
    for token in pointer.split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node
