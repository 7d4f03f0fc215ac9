"""What a JSON grammar refuses that the schema allows: the other half of the guarantee report.

Both backends (xgrammar 0.2.9, llguidance 1.9.1) write an object's declared properties in
the order the schema lists them, and any undeclared property after them, and write numbers in
one form (`0`, never `0.0` or `0e0`, for `const: 0` and for integers). Properties declared
across `allOf` branches that do not fold into one object (grammar_service/allof_merge.py) get
a fixed order too: llguidance writes them branch by branch, xgrammar the kept branch's first.
Some classes are one backend's (`BACKEND_CLASSES`): xgrammar writes an object or an array
where `type` is absent but properties or items are given, only relative references under
`format: uri-reference`, matches patterns against the whole string, and writes no escape
sequence in strings under a pattern or a length limit; llguidance does not count optional declared properties
toward `minProperties`. A document that differs only in such a form matches the schema and
is refused by the grammar. That never makes an output invalid, so `strict` does not refuse for it, but the
guarantee report names each class with the first place it applies (tests/unit/schemas/test_restrictions.py feeds a
valid document of each class to both backends).
"""
from __future__ import annotations

import json

from grammar_contract.report import UnenforcedKeyword
from grammar_service.look_around import name_patterns_without_look_around
from grammar_service.schema_walk import iter_subschemas

_ORDER = "declared properties are written in the order the schema lists them: a valid document in another order is refused"
_PLACE = "undeclared properties are written after the declared ones: a valid document with one before them is refused"
_SPLIT = ("properties declared across allOf branches that do not fold into one object are written in a "
          "fixed order: a valid document in another order is refused")
_INTEGER = "integers are written without a fraction or exponent: 1.0 and 1e0 are refused"
_LISTED = "listed numbers are written as the schema lists them: 0.0 for 0 is refused"
_INFERRED = ("xgrammar writes an {0} where `type` is absent and {1} are given: a valid value of another "
             "type is refused")
_URI_REFERENCE = "xgrammar writes a relative reference under format uri-reference: a valid absolute URI is refused"
_PATTERN = ("xgrammar matches {0} against the whole string, where JSON Schema finds it anywhere in it, reads "
            "some regex syntax differently and writes no escape sequence there: a valid {1} may be refused")
_LENGTH = ("xgrammar writes strings limited by length without escape sequences: a valid string with a quote, a "
           "backslash or an escaped character is refused")
_NAME_LOOK_AROUND = ("llguidance drops look-around assertions from a name pattern: a valid property whose "
                     "name they excluded must match the pattern's schema too, or is refused")
_MIN_PROPERTIES = ("llguidance counts only required and undeclared properties toward minProperties: a valid "
                   "document that reaches it with optional declared properties is refused")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _declaring_parts(schema: dict) -> int:
    """How many of the schema object and its `allOf` branches declare properties."""
    parts = [schema, *(b for b in schema.get("allOf") or () if isinstance(b, dict))] \
        if isinstance(schema.get("allOf"), list) else [schema]
    return sum(1 for part in parts if isinstance(part.get("properties"), dict) and part["properties"])


def _classes(schema: dict) -> list[tuple[str, str]]:
    """(keyword, reason) of each restriction this schema object brings."""
    found = []
    properties = schema.get("properties")
    if isinstance(properties, dict) and len(properties) > 1:
        found.append(("properties", _ORDER))
    if isinstance(properties, dict) and properties and schema.get("additionalProperties") is not False:
        found.append(("additionalProperties", _PLACE))
    if _declaring_parts(schema) > 1:  # allOf left unfolded (grammar_service/allof_merge.py)
        found.append(("allOf", _SPLIT))
    types = schema.get("type")
    if types == "integer" or (isinstance(types, list) and "integer" in types):
        found.append(("type", _INTEGER))
    listed = [schema["const"]] if "const" in schema else schema.get("enum") if isinstance(schema.get("enum"), list) else []
    if any(_is_number(v) for v in listed):
        found.append(("const" if "const" in schema else "enum", _LISTED))
    return found


def _xgrammar_classes(schema: dict) -> list[tuple[str, str]]:
    """Measured on xgrammar 0.2.9 (backends/xgrammar_unenforced.py: INFERS_TYPE)."""
    found = []
    if "type" not in schema and not any(k in schema for k in ("enum", "const", "$ref", "anyOf", "oneOf", "allOf")):
        if "properties" in schema or "additionalProperties" in schema:
            found.append(("type", _INFERRED.format("object", "properties")))
        elif "items" in schema or "prefixItems" in schema:
            found.append(("type", _INFERRED.format("array", "items")))
    if schema.get("format") == "uri-reference":
        found.append(("format", _URI_REFERENCE))
    if isinstance(schema.get("pattern"), str):
        found.append(("pattern", _PATTERN.format("pattern", "string")))
    if isinstance(schema.get("patternProperties"), dict) and schema["patternProperties"]:
        found.append(("patternProperties", _PATTERN.format("patternProperties' patterns", "property name")))
    lengths = [k for k in ("minLength", "maxLength") if _is_number(schema.get(k))]
    if lengths and "pattern" not in schema and "format" not in schema:  # beside those, lengths are dropped
        found.append((lengths[0], _LENGTH))
    return found


def _llguidance_classes(schema: dict) -> list[tuple[str, str]]:
    """Measured on llguidance 1.9.1: `{"minProperties": 1, "properties": {"a": {}}}` refuses
    {"a": 1} and takes {"a": 1, "z": 1}; exact where the required ones reach the minimum or
    additionalProperties is false (grammar_service/guarantees.py reports the counts too). A name
    pattern llguidance takes without its look-around (look_around.py) holds the names it
    excluded to its schema: where additionalProperties allows them anything, a refusal."""
    found = []
    additional = schema.get("additionalProperties")
    if name_patterns_without_look_around(schema) and (additional in (None, True) or additional == {}):
        found.append(("patternProperties", _NAME_LOOK_AROUND))
    return found + _min_properties(schema)


def _min_properties(schema: dict) -> list[tuple[str, str]]:
    minimum, properties = schema.get("minProperties"), schema.get("properties")
    required = set(schema.get("required") or ()) if isinstance(schema.get("required"), list) else set()
    if (_is_number(minimum) and isinstance(properties, dict) and set(properties) - required
            and minimum > len(required & set(properties)) and schema.get("additionalProperties") is not False):
        return [("minProperties", _MIN_PROPERTIES)]
    return []


BACKEND_CLASSES = {"xgrammar": _xgrammar_classes, "llguidance": _llguidance_classes}


def json_restrictions(schema_text: str, backend: str = "") -> tuple[UnenforcedKeyword, ...]:
    """One entry per restriction class in the schema, at the first place it applies (a count of
    the others in its reason), in document order; () for malformed JSON (the compile says so).
    `backend`: the one that compiled it, whose own classes are added ("": the shared ones)."""
    try:
        schema = json.loads(schema_text)
    except (ValueError, RecursionError):
        return ()
    first: dict[tuple[str, str], str] = {}
    counts: dict[tuple[str, str], int] = {}
    backend_classes = BACKEND_CLASSES.get(backend, lambda _: [])
    for pointer, subschema in iter_subschemas(schema):
        for entry in _classes(subschema) + backend_classes(subschema):
            first.setdefault(entry, pointer)
            counts[entry] = counts.get(entry, 0) + 1
    return tuple(UnenforcedKeyword(keyword, first[(keyword, reason)], reason + (
        f" (here and at {counts[(keyword, reason)] - 1} more places)" if counts[(keyword, reason)] > 1 else ""))
        for keyword, reason in first)
