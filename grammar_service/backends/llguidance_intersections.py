"""Schemas whose intersections llguidance cannot build, rewritten into equal ones it can.

llguidance compiles a schema's sibling keywords, `allOf` branches and `$ref` targets by
intersecting them, and three shapes of real-world schemas defeat that:

- a reference whose target is still being compiled (a cycle) cannot be intersected with
  anything ("circular references with sibling keys are not supported"): an `anyOf`/`oneOf`
  beside keywords (`type`, `minItems`) whose reference branches reach back to it, or an
  `allOf` branch that is such a reference;
- it never reduces R ∩ R: a parent that declares a property exactly as its `allOf`/`anyOf`
  branch does, where the property's schema is recursive, unrolls the recursion until
  "Schema intersection stack level exceeded";
- an `anyOf` of N branches under a parent property that is an enum of N values intersects
  each value with each branch: N² schema nodes ("schema too large" past its 50,000);
- a declared property that a `patternProperties` name also matches takes both schemas: where
  its own `allOf` holds the pattern's schema already, that schema meets itself (a `oneOf` of N
  events becomes N², "schema too large" or "initial lexer configuration too big").

Each rewrite below is exact (the same documents are valid):

- keywords beside an `anyOf`/`oneOf` move into its inline branches (`{"allOf": [kws, branch]}`)
  where they say nothing about what every reference branch's target can be (its `type`s): S ∧
  exactly-one(B) = exactly-one(S ∧ B);
- an `allOf` branch (or the target of a `$ref` with siblings) on a cycle is replaced by a copy
  of its target, once;
- a parent's property schema that every branch narrows further is dropped (`{}`), or kept as
  its `type` where the branch narrows only strings to one literal (`pattern: "^X$"`): P ∩ Q = Q
  when Q ⊆ P. Where the parent's schema is a reference's target, the branch's copy drops its
  equal schema instead;
- a declared property's `allOf` branch equal to the schema of a name pattern it matches goes:
  the pattern applies it anyway (whether the name matches is judged with Python's `re`).

Pointers: llguidance's report is walked on the schema before this rewrite (guarantees.py), so a
moved keyword moves no entry.
"""
from __future__ import annotations

import copy
import functools
import json
import re
from urllib.parse import unquote

from grammar_service.schema_walk import iter_subschemas, resolve_pointer

_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated",
                          "readOnly", "writeOnly", "markdownDescription", "$schema", "$id", "id"})
_NOT_MOVED = frozenset({"definitions", "$defs", "anyOf", "oneOf"}) | _ANNOTATIONS
_FOR_TYPES = {  # keywords that assert only on values of these types
    **dict.fromkeys(("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
                     "contains", "minContains", "maxContains", "unevaluatedItems"), {"array"}),
    **dict.fromkeys(("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                     "maxProperties", "propertyNames", "dependencies", "dependentRequired", "dependentSchemas",
                     "unevaluatedProperties"), {"object"}),
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), {"string"}),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
                    {"number", "integer"}),
}
_ASSERTING = frozenset(_FOR_TYPES) | {"type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then",
                                      "else", "$ref", "$dynamicRef", "$recursiveRef"}
_LITERAL = re.compile(r"^\^((?:[^\\.^$*+?()\[\]{}|]|\\[^A-Za-z0-9])*)\$$")  # "^X$" with X literal
_SCOPED = ('"$id"', '"$anchor"', '"$dynamicRef"', '"$recursiveRef"')  # a copy would move what these mean
_MAX_MOVED_BYTES = 1 << 16  # the copies of the keywords moved beside one anyOf
_MAX_COPIES = 64  # a copy holds references too: a bound on how often one rewrite copies
_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null",
               list: "array", dict: "object"}


class _Document:
    """The schema's local references: which targets are on a cycle through a given place."""

    def __init__(self, schema: dict):
        self.schema = schema
        self._inner: dict[str, set[str]] = {}
        self._reach: dict[str, frozenset[str]] = {}
        self.num_copies = 0

    @functools.cached_property
    def targets(self) -> frozenset[str]:
        return frozenset(p for _, n in iter_subschemas(self.schema) if (p := _local(n.get("$ref"))) is not None)

    def _refs_under(self, target: str) -> set[str]:
        if target not in self._inner:
            self._inner[target] = {r for _, n in iter_subschemas(resolve_pointer(self.schema, target), target)
                                   if (r := _local(n.get("$ref"))) is not None}
        return self._inner[target]

    def reach(self, target: str) -> frozenset[str]:
        """The targets that compiling `target` may compile in turn."""
        if target not in self._reach:
            seen, stack = set(), [target]
            while stack:
                for nxt in self._refs_under(stack.pop()):
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            self._reach[target] = frozenset(seen)
        return self._reach[target]

    def is_cycle(self, pointer: str, target: str) -> bool:
        """True when compiling `target` may come back to `pointer` before it is done."""
        reached = self.reach(target)
        return any(t in reached or t == target for t in _prefixes(pointer) if t in self.targets)

    def is_targeted(self, pointer: str) -> bool:
        """True when a reference points at `pointer` or into it."""
        return pointer in self._targeted

    @functools.cached_property
    def _targeted(self) -> frozenset[str]:
        return frozenset(p for t in self.targets for p in _prefixes(t))

    def copy_of(self, target: str) -> dict | None:
        node = resolve_pointer(self.schema, target)
        text = json.dumps(node) if isinstance(node, dict) else ""
        if not text or self.num_copies >= _MAX_COPIES or any(k in text for k in _SCOPED):
            return None
        self.num_copies += 1
        return {k: copy.deepcopy(v) for k, v in node.items() if k not in ("definitions", "$defs", "$schema", "id")}


def _local(ref) -> str | None:
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    fragment = unquote(ref[1:])
    return fragment if fragment == "" or fragment.startswith("/") else None


def _prefixes(pointer: str) -> list[str]:
    """`pointer` and every pointer that holds it ("/a/b" -> "", "/a", "/a/b")."""
    parts = pointer.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _bare_ref(node) -> str | None:
    """The local target of a schema that is only a reference (and annotations)."""
    if isinstance(node, dict) and set(node) - _ANNOTATIONS == {"$ref"}:
        return _local(node["$ref"])
    return None


def _types(doc: _Document, node, depth: int = 0) -> set[str] | None:
    """The JSON types every value valid under `node` has; None when unknown."""
    if not isinstance(node, dict) or depth > 8:
        return None
    if (target := _bare_ref(node)) is not None:
        return _types(doc, resolve_pointer(doc.schema, target), depth + 1)
    declared = node.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list) and all(isinstance(t, str) for t in declared):
        return set(declared)
    for key in ("anyOf", "oneOf"):  # a value has a type of the branch it matches
        if isinstance(node.get(key), list) and node[key]:
            parts = [_types(doc, b, depth + 1) for b in node[key]]
            if all(p is not None for p in parts):
                return set().union(*parts)
    if isinstance(node.get("allOf"), list):  # a value has the types of every branch
        parts = [p for b in node["allOf"] if (p := _types(doc, b, depth + 1)) is not None]
        if parts:
            return set.intersection(*parts)
    values = _values(node)
    return None if values is None else {_JSON_TYPES[type(v)] for v in values}


def _says_nothing_about(keywords: dict, types: set[str] | None) -> bool:
    """True when `keywords` hold for every value of these types."""
    if not types:
        return False
    for key, value in keywords.items():
        if key == "type":
            allowed = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else set()
            if not all(t in allowed or (t == "integer" and "number" in allowed) for t in types):
                return False
        elif key not in _FOR_TYPES or types & _FOR_TYPES[key]:
            return False
    return True


def _values(node, exact: bool = False) -> list | None:
    """The finite set of values a schema admits at most (const/enum, or any-/oneOf of them);
    `exact`: only where no other keyword narrows it further. None if not finite."""
    if not isinstance(node, dict):
        return None
    for key in ("const", "enum", "anyOf", "oneOf"):
        if key in node and exact and set(node) & _ASSERTING != {key}:
            return None
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return node["enum"]
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not set(node) & _ASSERTING - {key}:
            parts = [_values(b, exact) for b in node[key]]
            return None if any(p is None for p in parts) else [v for p in parts for v in p]
    return None


def _narrowed(doc: _Document, outer, inner) -> dict | bool | None:
    """What `outer` may become beside `inner` (outer ∩ inner unchanged), or None: {} where
    `inner` is `outer`, {"type": ...} where `inner` admits one of outer's strings; False where
    it admits none of them (outer ∩ inner is empty)."""
    target = _bare_ref(inner)
    if inner == outer or target is not None and (target == _bare_ref(outer) or resolve_pointer(doc.schema, target) is outer):
        return {}
    outer_values, pattern = _values(outer, exact=True), inner.get("pattern") if isinstance(inner, dict) else None
    literal = _LITERAL.match(pattern) if isinstance(pattern, str) else None
    if outer_values is None or literal is None:
        return None
    if not all(isinstance(v, str) for v in outer_values):
        return None
    return {"type": "string"} if re.sub(r"\\(.)", r"\1", literal[1]) in outer_values else False


def _branch_target(doc: _Document, branch):
    """A branch as llguidance intersects it: a bare reference's target, else the branch."""
    target = _bare_ref(branch)
    return branch if target is None else resolve_pointer(doc.schema, target)


def _copy_cyclic_branches(doc: _Document, pointer: str, node: dict) -> bool:
    """Replaces `allOf` branches that are references on a cycle, and a `$ref` on a cycle beside
    other keywords, by a copy of their target (module doc)."""
    changed = False
    branches = node.get("allOf")
    if isinstance(branches, list) and (len(branches) > 1 or set(node) - _NOT_MOVED - {"allOf"}):
        for index, branch in enumerate(branches):
            target = _bare_ref(branch)
            if target is not None and doc.is_cycle(pointer, target) and (copied := doc.copy_of(target)) is not None:
                branches[index] = copied
                changed = True
    target = _local(node.get("$ref"))
    if target is not None and set(node) - _NOT_MOVED - {"$ref"} and doc.is_cycle(pointer, target) \
            and (copied := doc.copy_of(target)) is not None:
        del node["$ref"]
        node["allOf"] = [*node.get("allOf", []), copied] if isinstance(node.get("allOf"), list) else [copied]
        changed = True
    return changed


def _drop_repeated_properties(doc: _Document, pointer: str, node: dict) -> bool:
    """Drops a parent's property schema that its branches narrow anyway (module doc)."""
    properties = node.get("properties")
    if not isinstance(properties, dict) or not any(isinstance(node.get(k), list) for k in ("allOf", "anyOf", "oneOf")):
        return False
    changed = False
    for name, outer in properties.items():
        if not isinstance(outer, dict) or not set(outer) - _ANNOTATIONS:
            continue
        here = f"{pointer}/properties/{_escape(name)}"
        if doc.is_targeted(here):
            changed |= _drop_in_branches(doc, pointer, node, name, outer)
            continue
        for key in ("allOf", "anyOf", "oneOf"):
            branches = node.get(key)
            if not isinstance(branches, list) or not branches:
                continue
            narrowed = [_narrowed(doc, outer, _property(doc, b, name)) for b in branches]
            for index, branch in enumerate(branches):  # a branch that admits none of outer: none at all
                if narrowed[index] is False and _bare_ref(branch) is None \
                        and not doc.is_targeted(f"{pointer}/{key}/{index}/properties/{_escape(name)}"):
                    branch["properties"][name], narrowed[index] = False, {"type": "string"}
            found = [n for n in narrowed if isinstance(n, dict)]
            if found and (key == "allOf" or len(found) == len(branches)):
                properties[name] = {} if key == "allOf" and {} in found else max(found, key=len)
                changed = True
                break
    return changed


def _drop_in_branches(doc: _Document, pointer: str, node: dict, name: str, outer: dict) -> bool:
    """Where the parent's property schema is a reference's target: the inline `allOf` branches
    drop their equal schema of it instead (P ∩ P = P ∩ {})."""
    changed = False
    branches = node.get("allOf")
    for index, branch in enumerate(branches if isinstance(branches, list) else ()):
        where = f"{pointer}/allOf/{index}/properties/{_escape(name)}"
        if _narrowed(doc, outer, _property(doc, branch, name)) != {}:
            continue
        if (target := _bare_ref(branch)) is not None:
            branch = branches[index] = doc.copy_of(target) or branch
        elif doc.is_targeted(where):
            continue
        if _bare_ref(branch) is None:
            branch["properties"][name] = {}
            changed = True
    return changed


def _drop_repeated_in_all_of(doc: _Document, pointer: str, node: dict) -> bool:
    """An inline `allOf` branch drops a property schema that an earlier branch gives the same."""
    branches = node.get("allOf")
    if not isinstance(branches, list):
        return False
    changed = False
    for index, branch in enumerate(branches):
        if _bare_ref(branch) is not None or not isinstance(branch, dict) or not isinstance(branch.get("properties"), dict):
            continue
        for name, inner in branch["properties"].items():
            if not isinstance(inner, dict) or not set(inner) - _ANNOTATIONS \
                    or doc.is_targeted(f"{pointer}/allOf/{index}/properties/{_escape(name)}"):
                continue
            earlier = (_property(doc, b, name) for b in branches[:index])
            if any(isinstance(e, dict) and _narrowed(doc, e, inner) == {} for e in earlier):
                branch["properties"][name] = {}
                changed = True
    return changed


def _drop_pattern_repeats(doc: _Document, pointer: str, node: dict) -> bool:
    """A declared property that a `patternProperties` name matches takes that name's schema too:
    where its own `allOf` holds that schema already, the branch goes (judged with Python's `re`)."""
    properties, patterns = node.get("properties"), node.get("patternProperties")
    if not isinstance(properties, dict) or not isinstance(patterns, dict):
        return False
    changed = False
    for name, own in properties.items():
        branches = own.get("allOf") if isinstance(own, dict) else None
        if not isinstance(branches, list) or doc.is_targeted(f"{pointer}/properties/{_escape(name)}/allOf"):
            continue
        for regex, schema in patterns.items():
            try:
                matched = re.search(regex, name) is not None
            except re.error:
                continue
            kept = [b for b in branches if not matched or _narrowed(doc, schema, b) != {}]
            if len(kept) < len(branches):
                branches[:] = kept
                changed = True
        if not branches:
            del own["allOf"]
    return changed


def _property(doc: _Document, branch, name: str):
    target = _branch_target(doc, branch)
    properties = target.get("properties") if isinstance(target, dict) else None
    return properties.get(name) if isinstance(properties, dict) else None


def _move_siblings(doc: _Document, pointer: str, node: dict) -> bool:
    """Moves the keywords beside an `anyOf`/`oneOf` into its inline branches where its reference
    branches reach back here and the keywords hold for all their targets (module doc)."""
    keys = [k for k in ("anyOf", "oneOf") if isinstance(node.get(k), list)]
    siblings = {k: v for k, v in node.items() if k not in _NOT_MOVED}
    if len(keys) != 1 or not siblings or "allOf" in node or "$ref" in node:
        return False
    branches = node[keys[0]]
    targets = [t for b in branches if (t := _bare_ref(b)) is not None]
    if not any(doc.is_cycle(pointer, t) for t in targets):
        return False
    if not all(_says_nothing_about(siblings, _types(doc, resolve_pointer(doc.schema, t))) for t in targets):
        return False
    if len(json.dumps(siblings)) * (len(branches) - len(targets)) > _MAX_MOVED_BYTES:
        return False  # each inline branch gets a copy: llguidance would compile them all
    node[keys[0]] = [b if _bare_ref(b) is not None else {"allOf": [copy.deepcopy(siblings), b]} for b in branches]
    for key in siblings:
        del node[key]
    return True


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def untangle(schema: dict) -> bool:
    """Rewrites, in place, the intersections llguidance cannot build into equal ones (module
    doc); True if any changed."""
    doc = _Document(schema)
    changed = False
    for pointer, node in iter_subschemas(schema):
        changed |= _copy_cyclic_branches(doc, pointer, node)
        changed |= _drop_repeated_properties(doc, pointer, node)
        changed |= _drop_repeated_in_all_of(doc, pointer, node)
        changed |= _drop_pattern_repeats(doc, pointer, node)
        changed |= _move_siblings(doc, pointer, node)
    return changed
