"""`allOf` object branches folded into one object schema, where that is exact.

xgrammar compiles a parent with several `allOf` branches weakly (the report names it), and
llguidance writes properties split across branches in branch order, which no `properties`
entry of the schema shows. Folded into the parent, the properties are one object that both
backends compile exactly and that the restriction report sees (grammar_service/restrictions.py).

A branch is folded only when the result accepts exactly the documents the parent and the
branch accept together:
- `type`s intersect (an integer is a number); `required` lists unite; `properties` unite, a
  name declared in both parts taking `{"allOf": [both]}` (folded in turn where it can be);
- `additionalProperties` (and `patternProperties`, which decides what is additional) may come
  from one part only, and that part must declare every property the other declares: otherwise
  its additional-property rule would stop applying to names the other part adds;
- any other keyword may appear in one part only (or with the same value in both), and the
  keywords that read each other (`items`/`prefixItems`/`additionalItems`,
  `contains`/`minContains`/`maxContains`, `if`/`then`/`else`, and a bound with its draft-4
  boolean `exclusive*`) must come from one part;
- a branch that is a local `$ref` is folded as a copy of its target when the target holds no
  `$ref` or `$id` of its own (a copy must not move a base URI or a cycle); a branch with other
  identifiers, `$defs`, `unevaluated*` or a `$ref` left is kept as a branch.
Branches that cannot be folded stay under `allOf`, and the backends' reports then name what
they do with them. Annotations of folded branches (`title`, `description`, ...) are dropped:
they assert nothing.
"""
from __future__ import annotations

import copy
from typing import Any

from grammar_service.schema_walk import iter_subschemas, resolve_pointer

_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated",
                          "readOnly", "writeOnly"})
_NOT_FOLDED = frozenset({"$ref", "$id", "id", "$anchor", "$dynamicAnchor", "$dynamicRef", "$recursiveRef",
                         "$recursiveAnchor", "$defs", "definitions", "$schema", "unevaluatedProperties",
                         "unevaluatedItems", "allOf"})
_TOGETHER = (frozenset({"items", "prefixItems", "additionalItems"}),
             frozenset({"contains", "minContains", "maxContains"}),
             frozenset({"if", "then", "else"}),
             frozenset({"minimum", "exclusiveMinimum"}),  # draft 4: a boolean exclusive bound
             frozenset({"maximum", "exclusiveMaximum"}))  # changes the bound beside it
_OBJECT_RULES = ("additionalProperties", "patternProperties")


def _types(value) -> set[str] | None:
    if isinstance(value, str):
        return {value}
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return set(value)
    return None


def _intersect_types(a, b):
    left, right = _types(a), _types(b)
    if left is None or right is None:
        return None
    both = left & right
    if ("integer" in left and "number" in right) or ("number" in left and "integer" in right):
        both.add("integer")
    if not both:
        return None  # unsatisfiable: left for the backend to say
    ordered = [t for t in ([a] if isinstance(a, str) else a) if t in both] + sorted(both - set(_types(a)))
    return ordered[0] if len(ordered) == 1 else ordered


def _rules(part: dict) -> dict:
    return {k: part[k] for k in _OBJECT_RULES if k in part and part[k] is not True}


def _names(schema: dict) -> set[str]:
    properties = schema.get("properties")
    return set(properties) if isinstance(properties, dict) else set()


def _fold(acc: dict, part: dict) -> dict | None:
    """acc and part as one schema, or None when that would not be exact (module doc)."""
    if any(k in part for k in _NOT_FOLDED) or "unevaluatedProperties" in acc or "unevaluatedItems" in acc:
        return None
    for group in _TOGETHER:
        if group & acc.keys() and group & part.keys():
            return None
    acc_rules, part_rules = _rules(acc), _rules(part)
    if acc_rules and part_rules:
        return None
    if (acc_rules and not _names(part) <= _names(acc)) or (part_rules and not _names(acc) <= _names(part)):
        return None
    out = {k: v for k, v in acc.items() if k not in _OBJECT_RULES or k in acc_rules}
    out.update(part_rules)
    for key, value in part.items():
        if key in _ANNOTATIONS or key in _OBJECT_RULES:
            continue
        if key not in out or out[key] == value:
            out[key] = copy.deepcopy(value)
        elif key == "type":
            out[key] = _intersect_types(out[key], value)
            if out[key] is None:
                return None
        elif key == "required" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = out[key] + [n for n in value if n not in out[key]]
        elif key == "properties" and isinstance(value, dict) and isinstance(out[key], dict):
            merged = dict(out[key])
            for name, sub in value.items():
                merged[name] = sub if name not in merged or merged[name] == sub else \
                    _folded({"allOf": [merged[name], sub]})
            out[key] = merged
        else:
            return None
    return out


def _target(root: dict, ref) -> Any:
    """The copy a local `$ref` names, when it is safe to fold (module doc); else None."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node: Any = resolve_pointer(root, ref[1:])
    if not isinstance(node, dict) or any(k in s for _, s in iter_subschemas(node) for k in ("$ref", "$id", "id")):
        return None
    return _folded(copy.deepcopy(node))


def _folded(schema: dict, root: dict | None = None) -> dict:
    """`schema` with its own `allOf` folded where exact (subschemas are folded by the caller)."""
    branches = schema.get("allOf")
    if not isinstance(branches, list) or not branches:
        return schema
    acc, kept = {k: v for k, v in schema.items() if k != "allOf"}, []
    for branch in branches:
        if branch is True or branch == {}:
            continue
        if isinstance(branch, dict) and set(branch) == {"$ref"} and root is not None:
            branch = _target(root, branch["$ref"]) or branch
        folded = _fold(acc, branch) if isinstance(branch, dict) else None
        if folded is None:
            kept.append(branch)
        else:
            acc = folded
    if kept:
        acc["allOf"] = kept
    return acc


def fold_all_of(schema) -> bool:
    """Folds every `allOf` in `schema` in place, innermost first; True if any changed."""
    if not isinstance(schema, dict):
        return False
    changed = False
    for _, node in reversed(list(iter_subschemas(schema))):
        if isinstance(node.get("allOf"), list):
            folded = _folded(node, schema)
            if folded != node:
                node.clear()
                node.update(folded)
                changed = True
    return changed
