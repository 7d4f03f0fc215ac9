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
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_MAX_REFS = 32  # $ref hops followed from one place (cycles)


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
    """The schema objects that declare properties for `value` at `node`, in the order used."""
    parts = []
    for part in _resolve(root, node):
        parts.append(part)
        if depth < _MAX_REFS and isinstance(part.get("allOf"), list):
            for branch in part["allOf"]:
                parts.extend(_parts(root, branch, value, depth + 1))
    if depth == 0:  # the anyOf/oneOf branch that declares most of the keys, one level
        keys = set(value) if isinstance(value, dict) else set()
        for part in list(parts):
            for word in ("anyOf", "oneOf"):
                if isinstance(part.get(word), list) and part[word]:
                    branches = [_parts(root, b, value, 1) for b in part[word]]
                    parts.extend(max(branches, key=lambda ps: len(keys & _declared(ps))))
    return parts


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
