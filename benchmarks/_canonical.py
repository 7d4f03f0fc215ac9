"""A valid document rewritten in the forms the grammars fix, for benchmarks/schema_truth.py to
tell a refusal the guarantee report names (grammar_service/restrictions.py) from a silent one.

`in_declared_order` puts every object's declared properties in the order the schema lists
them (the object's own `properties`, then its `$ref`'s and `allOf` branches', then the
`anyOf`/`oneOf` branch that declares most of its keys) and undeclared ones after them, as
both backends write objects; `with_integral_numbers` writes 6000.0 as 6000. Neither changes
what the document means to JSON Schema (order is free; 6000.0 == 6000), so a refused document
whose rewrite is accepted was refused for that form. The walk is a best effort (local `$ref`
only): a rewrite it gets wrong is refused too, and the refusal then counts as silent, never
as named.

`SCHEMA_REWRITES` change the schema instead, one backend-specific restriction class each
(grammar_service/restrictions.py): a refused document that the grammar of the rewritten
schema accepts was refused for that class.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from grammar_service.schema_walk import iter_subschemas

_MAX_REFS = 32  # $ref hops followed from one place (cycles)
_MAX_DEPTH = 8  # nested allOf/anyOf/oneOf levels looked into


@dataclass
class Moves:
    declared: bool = False     # declared properties were in another order
    undeclared: bool = False   # an undeclared property came before a declared one


def _resolve(root, node, hops: int = 0):
    """`node` with its local `$ref` chain resolved into parts: [siblings, target, ...]."""
    if not isinstance(node, dict):
        return []
    ref = node.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#") or hops >= _MAX_REFS:
        return [node]
    target = root
    for step in [s for s in ref[1:].split("/") if s]:
        step = step.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and step in target:
            target = target[step]
        elif isinstance(target, list) and step.isdigit() and int(step) < len(target):
            target = target[int(step)]
        else:
            return [node]
    return [node, *_resolve(root, target, hops + 1)]


def _parts(root, node, value, depth: int = 0) -> list[dict]:
    """The schema objects that declare properties for `value` at `node`, in the order used:
    each with its `$ref` chain and `allOf` branches, and of each `anyOf`/`oneOf` the branch
    that declares most of the value's keys."""
    parts = []
    for part in _resolve(root, node):
        parts.append(part)
        if depth >= _MAX_DEPTH:
            continue
        for branch in part.get("allOf") if isinstance(part.get("allOf"), list) else ():
            parts.extend(_parts(root, branch, value, depth + 1))
        for word in ("anyOf", "oneOf"):
            if isinstance(part.get(word), list) and part[word]:
                branches = [_parts(root, b, value, depth + 1) for b in part[word]]
                parts.extend(max(branches, key=lambda ps: _fit(root, ps, value)))
    return parts


_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
               int: "integer", float: "number"}


def _fit(root, parts: list[dict], value) -> int:
    """How well a branch fits `value`: -1 for another type, else the keys it declares (of the
    value, or of the value's object items)."""
    types = set()
    for part in parts:
        t = part.get("type")
        types |= {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()
    kind = _JSON_TYPES.get(type(value), "")
    if types and kind not in types and not (kind == "integer" and "number" in types):
        return -1
    if isinstance(value, dict):
        return len(set(value) & _declared(parts)) + 100 * _discriminated(parts, value)
    if isinstance(value, list):
        return sum(len(set(v) & _declared(_parts(root, _item(parts, i), v, _MAX_DEPTH)))
                   for i, v in enumerate(value) if isinstance(v, dict))
    return 0


def _discriminated(parts: list[dict], value: dict) -> int:
    """Listed-value properties (`const`/`enum`, a discriminator) the value matches, less those it breaks."""
    score = 0
    for part in parts:
        for key, sub in (part.get("properties") or {}).items() if isinstance(part.get("properties"), dict) else ():
            if key in value and isinstance(sub, dict) and ("const" in sub or isinstance(sub.get("enum"), list)):
                listed = [sub["const"]] if "const" in sub else sub["enum"]
                score += 1 if value[key] in listed else -1
    return score


def _declared(parts: list[dict]) -> set:
    return {k for p in parts if isinstance(p.get("properties"), dict) for k in p["properties"]}


def _child(parts: list[dict], key: str):
    for part in parts:
        if isinstance(part.get("properties"), dict) and key in part["properties"]:
            return part["properties"][key]
    for part in parts:
        for pattern, sub in (part.get("patternProperties") or {}).items() if isinstance(
                part.get("patternProperties"), dict) else ():
            try:
                if re.search(pattern, key):
                    return sub
            except re.error:
                continue
    for part in parts:
        if isinstance(part.get("additionalProperties"), dict):
            return part["additionalProperties"]
    return {}


def _item(parts: list[dict], index: int):
    for part in parts:
        prefix = part.get("prefixItems") if isinstance(part.get("prefixItems"), list) else (
            part.get("items") if isinstance(part.get("items"), list) else [])
        if index < len(prefix):
            return prefix[index]
        if isinstance(part.get("items"), dict):
            return part["items"]
    return {}


def in_declared_order(root, value, moves: Moves, node=None):
    """`value` with every object's keys as the grammars write them; `moves` records what moved."""
    parts = _parts(root, root if node is None else node, value)
    if isinstance(value, dict):
        order: list = []
        for part in parts:
            for key in part.get("properties") or {} if isinstance(part.get("properties"), dict) else ():
                if key in value and key not in order:
                    order.append(key)
        rest = [k for k in value if k not in order]
        given_declared = [k for k in value if k in order]
        moves.declared |= given_declared != order
        first_undeclared = min((i for i, k in enumerate(value) if k in rest), default=len(value))
        moves.undeclared |= any(k in order for k in list(value)[first_undeclared:])
        return {k: in_declared_order(root, value[k], moves, _child(parts, k)) for k in order + rest}
    if isinstance(value, list):
        return [in_declared_order(root, v, moves, _item(parts, i)) for i, v in enumerate(value)]
    return value


def with_integral_numbers(value):
    """`value` with every float that is an integer written as one (6000.0 -> 6000)."""
    if isinstance(value, dict):
        return {k: with_integral_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [with_integral_numbers(v) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)
    return value


_ALL_TYPES = ["object", "array", "string", "number", "boolean", "null"]
_INFERS = ("properties", "additionalProperties", "items", "prefixItems")
_EXPLICIT = ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf")


def _rewritten(schema, change) -> object:
    """A copy of `schema` with `change(subschema)` applied to every subschema object."""
    out = copy.deepcopy(schema)
    for _, subschema in list(iter_subschemas(out)):
        change(subschema)
    return out


def _drop_min_properties(subschema: dict) -> None:
    subschema.pop("minProperties", None)


def _drop_uri_reference(subschema: dict) -> None:
    if subschema.get("format") == "uri-reference":
        del subschema["format"]


def _type_every_value(subschema: dict) -> None:
    """An untyped schema with properties or items takes every type (as JSON Schema means it)."""
    if any(k in subschema for k in _INFERS) and not any(k in subschema for k in _EXPLICIT):
        subschema["type"] = list(_ALL_TYPES)


def _free_strings(subschema: dict) -> None:
    """No pattern or length limit, and no property-name pattern: a name a pattern matched is an
    additional property whose value is any of the patterns' schemas (xgrammar writes no escape
    sequence in a name under a pattern, whatever the pattern; `[\\s\\S]*` would not free it)."""
    for keyword in ("pattern", "minLength", "maxLength"):
        subschema.pop(keyword, None)
    patterned = subschema.pop("patternProperties", None)
    if not isinstance(patterned, dict) or not patterned:
        return
    extra = subschema.get("additionalProperties", {})
    if extra is False:
        subschema["additionalProperties"] = {"anyOf": list(patterned.values())}
    elif isinstance(extra, dict) and extra:
        subschema["additionalProperties"] = {"anyOf": [*patterned.values(), extra]}


# (class, the restriction keywords that name it, a fragment of the reason where a keyword names
# two classes, schema rewrite)
SCHEMA_REWRITES = (
    ("min_properties", ("minProperties",), "", lambda s: _rewritten(s, _drop_min_properties)),
    ("uri_reference", ("format",), "uri-reference", lambda s: _rewritten(s, _drop_uri_reference)),
    ("untyped", ("type",), "`type` is absent", lambda s: _rewritten(s, _type_every_value)),
    ("string_form", ("pattern", "patternProperties", "minLength", "maxLength"), "",
     lambda s: _rewritten(s, _free_strings)),
)
