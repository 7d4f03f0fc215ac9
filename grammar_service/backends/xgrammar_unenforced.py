"""Which JSON Schema keywords xgrammar's converter does not enforce (checked against 0.2.9).

Each rule below was verified by compiling a schema that uses the keyword and feeding the
matcher an instance that violates it: the matcher accepts that instance (see
tests/unit/grammar/test_unenforced.py, which keeps this list honest). Keywords that the
converter does enforce and that were checked the same way: type, enum, const, properties,
required, additionalProperties, unevaluatedProperties/Items, patternProperties,
propertyNames, min/maxProperties, items, prefixItems, min/maxItems, minimum, maximum,
exclusive bounds, multipleOf on integers, pattern without look-ahead, the formats in
ENFORCED_FORMATS, anyOf, $ref, and oneOf whose branches have distinct types, each alone.
Measured weakenings that are not a keyword being ignored outright: every assertion beside
`$ref`, and beside `anyOf`/`oneOf`/`allOf` (but `enum`/`const`, and a parent `type` that
every branch repeats), is dropped; without `type`, an object or array is inferred from its
keywords and otherwise every assertion is dropped; a required name that `properties` does
not declare is not required; look-ahead in `pattern` is dropped (look-behind does not
compile); `pattern` beside an enforced `format` is dropped; `patternProperties` beside
`properties` lets matching keys, and the declared properties too, take additionalProperties'
values (unless that is false); beside `enum`/`const` only the listed values are compiled, every
other assertion dropped (a gap where a listed value breaks it); strings with
minLength/maxLength admit raw control characters.
"""
from __future__ import annotations

from typing import Any, Iterator

# imported with the backend (before a compile worker is ready): the import takes ~1 s, which a
# first compile would otherwise pay
import jsonschema

from grammar_contract.report import UnenforcedKeyword
from grammar_service.schema_walk import escape

ENFORCED_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# keyword -> reason; the whole keyword (and any subschema under it) is ignored.
IGNORED = {
    "not": "the grammar cannot exclude what a subschema matches",
    "if": "conditional subschemas (if/then/else) are ignored",
    "uniqueItems": "the grammar cannot compare array items with each other",
    "contains": "the grammar does not require an item matching 'contains'",
    "maxContains": "the grammar does not count items matching 'contains'",
    "dependentSchemas": "schemas that depend on a property's presence are ignored",
    "dependentRequired": "properties required by another property's presence are not required",
    "dependencies": "property dependencies are ignored",
    "contentEncoding": "encoded string content is not checked",
    "contentMediaType": "encoded string content is not checked",
    "contentSchema": "encoded string content is not checked",
}
# Keywords that constrain an instance (everything else is an annotation, a definition or an
# unknown keyword, which no validator checks either).
ASSERTIONS = (
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "propertyNames", "minProperties", "maxProperties", "items", "prefixItems", "additionalItems",
    "minItems", "maxItems", "uniqueItems", "contains", "minContains", "maxContains", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength",
    "pattern", "format", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentRequired",
    "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems",
)
_COMBINATORS = ("anyOf", "oneOf", "allOf")
# without `type`, these make xgrammar write an object (the first two) or an array (measured)
INFERS_TYPE = ("properties", "additionalProperties", "items", "prefixItems")
_LOOKAHEAD = ("(?=", "(?!")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "unevaluatedItems",
                  "propertyNames", "additionalItems")


def _is_number_schema(schema: dict) -> bool:
    types = schema.get("type")
    types = [types] if isinstance(types, str) else (types or [])
    return "number" in types or not types


def _type_set(schema: Any) -> set[str] | None:
    types = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(types, str):
        types = [types]
    if not isinstance(types, list) or not types:
        return None
    return {"number" if t == "integer" else t for t in types} | ({"integer"} if "integer" in types else set())


def _beside_combinator(schema: dict, pointer: str) -> Iterator[UnenforcedKeyword]:
    """Measured: beside anyOf/oneOf/allOf xgrammar compiles only the branches; the parent's
    other assertions (type, properties, required, minimum, maxLength, ...) are dropped.
    `enum`/`const` stay enforced. The parent's `type` is kept in effect when every branch
    names a type within it."""
    combinators = [k for k in _COMBINATORS if isinstance(schema.get(k), list) and schema[k]]
    if not combinators:
        return
    branches = [b for k in combinators for b in schema[k]]
    parent_types = _type_set(schema)
    for keyword in ASSERTIONS:
        if keyword not in schema or keyword in _COMBINATORS or keyword in ("enum", "const") or keyword in IGNORED:
            continue
        if keyword == "type" and parent_types is not None and all(
                (_type_set(b) or {"?"}) <= parent_types for b in branches):
            continue
        yield UnenforcedKeyword(keyword, pointer, f"ignored beside {combinators[0]}: xgrammar compiles "
                                "only the branches")


def _beside_values(schema: dict, pointer: str) -> Iterator[UnenforcedKeyword]:
    """Measured: beside enum/const xgrammar compiles the listed values alone and drops every
    other assertion (`{"enum": ["a"], "type": "object"}` takes "a"). A dropped keyword is a gap
    only where a listed value breaks it, which the validator says; where it cannot tell (a
    reference it cannot resolve from here), every sibling is reported."""
    if "const" in schema:
        values = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        values = schema["enum"]
    else:
        return
    rest = {k: v for k, v in schema.items() if k not in ("enum", "const")}
    siblings = [k for k in ASSERTIONS if k in rest and k not in IGNORED]
    if not siblings:
        return
    try:
        validator = jsonschema.Draft202012Validator(rest)
        broken = {error.relative_schema_path[0] for value in values for error in validator.iter_errors(value)}
    except Exception:  # noqa: BLE001 -- unresolvable $ref, bad regex...: cannot tell, so report
        broken = set(siblings)
    for keyword in siblings:
        if keyword in broken:
            yield UnenforcedKeyword(keyword, pointer, f"ignored beside {'const' if 'const' in schema else 'enum'}: "
                                    "xgrammar compiles only the listed values, and some break it")


def _untyped(schema: dict, pointer: str) -> Iterator[UnenforcedKeyword]:
    """Measured: without `type` (and without enum/const, $ref or a combinator, checked apart)
    xgrammar writes an object where properties/additionalProperties are given, an array where
    items/prefixItems are, and else any JSON value, dropping every assertion there
    (`{"pattern": "^a"}` takes "zzz", `{"required": ["a"]}` takes {})."""
    if "type" in schema or any(k in schema for k in ("enum", "const", "$ref", *_COMBINATORS, *INFERS_TYPE)):
        return
    if pointer.endswith("/propertyNames"):  # a property name is a string: its keywords hold
        return
    for keyword in ASSERTIONS:
        if keyword in schema and keyword not in IGNORED:
            yield UnenforcedKeyword(keyword, pointer, "ignored in a schema without `type`: xgrammar "
                                    "compiles any JSON value there")


def _required_undeclared(schema: dict, pointer: str) -> Iterator[UnenforcedKeyword]:
    """Measured: a required name that `properties` does not declare is not required
    (`{"type": "object", "required": ["a"]}` takes {}), patternProperties or not."""
    required, declared = schema.get("required"), schema.get("properties")
    if not isinstance(required, list) or "$ref" in schema or any(k in schema for k in _COMBINATORS):
        return
    missing = [n for n in required if not (isinstance(declared, dict) and n in declared)]
    if missing:
        yield UnenforcedKeyword("required", pointer, "required properties that `properties` does not declare "
                                f"are not required ({', '.join(map(str, missing[:3]))}{', ...' if len(missing) > 3 else ''})")


def _local(schema: dict, pointer: str) -> Iterator[UnenforcedKeyword]:
    """Unenforced keywords of this schema object alone (not its subschemas)."""
    if "$ref" in schema:  # measured: xgrammar compiles the reference and drops every sibling
        for keyword in ASSERTIONS:
            if keyword in schema:
                yield UnenforcedKeyword(keyword, pointer, "ignored beside $ref: xgrammar compiles "
                                        "only the referenced schema")
        return
    yield from _beside_combinator(schema, pointer)
    yield from _beside_values(schema, pointer)
    yield from _untyped(schema, pointer)
    yield from _required_undeclared(schema, pointer)
    for keyword, reason in IGNORED.items():
        if keyword in schema:
            yield UnenforcedKeyword(keyword, pointer, reason)
    if "multipleOf" in schema and _is_number_schema(schema):
        yield UnenforcedKeyword("multipleOf", pointer, "multipleOf is enforced on integers only")
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in ENFORCED_FORMATS:
        yield UnenforcedKeyword("format", pointer, f"format {fmt!r} is not enforced")
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and isinstance(fmt, str) and fmt in ENFORCED_FORMATS:
        yield UnenforcedKeyword("pattern", pointer, f"pattern is ignored beside format {fmt!r}")
    elif isinstance(pattern, str) and any(look in pattern for look in _LOOKAHEAD):
        yield UnenforcedKeyword("pattern", pointer, "look-ahead assertions in the pattern are ignored")
    if schema.get("patternProperties") and schema.get("properties") and schema.get("additionalProperties") is not False:
        yield UnenforcedKeyword("patternProperties", pointer, "beside properties, keys matching a "
                                "pattern may take any value allowed to additional properties")
        yield UnenforcedKeyword("properties", pointer, "beside patternProperties, declared properties "
                                "may take any value allowed to additional properties")
    for keyword in ("minLength", "maxLength"):
        if keyword not in schema:
            continue
        if "pattern" in schema or "format" in schema:
            yield UnenforcedKeyword(keyword, pointer, f"{keyword} is ignored when combined "
                                    "with pattern or format")
        else:
            yield UnenforcedKeyword(keyword, pointer, "strings limited by length may contain raw "
                                    "control characters (the output is then not JSON)")
    if len(schema.get("allOf") or ()) > 1:
        yield UnenforcedKeyword("allOf", pointer, "allOf with several subschemas is only "
                                "partly enforced")
    branches = schema.get("oneOf") or ()
    # Provably disjoint only when every branch names one type and no two types overlap
    # (every integer is a number).
    types = [b.get("type") for b in branches if isinstance(b, dict)]
    types = [("number" if t == "integer" else t) for t in types if isinstance(t, str)]
    if len(branches) > 1 and (len(types) < len(branches) or len(set(types)) < len(types)):
        yield UnenforcedKeyword("oneOf", pointer, "branches that may overlap are enforced as "
                                "anyOf (at least one matches, not exactly one)")


def _children(schema: dict, pointer: str) -> Iterator[tuple[Any, str]]:
    if "$ref" in schema:  # the siblings are not compiled (reported whole); definitions are
        for key in ("$defs", "definitions"):
            for name, sub in (schema.get(key) or {}).items():
                yield sub, f"{pointer}/{key}/{escape(name)}"
        return
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            yield sub, f"{pointer}/{key}/{escape(name)}"
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or ()):
            yield sub, f"{pointer}/{key}/{i}"
    for key in _SUBSCHEMA_ONE:
        if key in schema:
            yield schema[key], f"{pointer}/{key}"
    items = schema.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            yield sub, f"{pointer}/items/{i}"
    elif items is not None:
        yield items, f"{pointer}/items"


def find_unenforced(schema: Any, pointer: str = "") -> list[UnenforcedKeyword]:
    """All unenforced keywords in `schema`, depth first, with RFC 6901 pointers."""
    if not isinstance(schema, dict):
        return []
    found = list({(u.keyword, u.pointer): u for u in reversed(list(_local(schema, pointer)))}.values())[::-1]
    for sub, sub_pointer in _children(schema, pointer):
        found.extend(find_unenforced(sub, sub_pointer))
    return found
