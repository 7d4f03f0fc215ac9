"""What the llguidance grammar enforces of a JSON Schema (`auto`'s ranking of the backends,
which reads it, is grammar_service/auto_choice.py).

A grammar can only enforce what a left-to-right token mask can express. Keywords that
compare values (`uniqueItems`), negate (`not`), branch on content (`if`/`then`/`else`) or
need exclusivity (`oneOf` with overlapping branches) are compiled weaker than the schema.
The user hears about each, with its JSON pointer, before the first token; `strict`
requests are refused instead (grammar_service.compiler).

xgrammar's rules live in backends/xgrammar_unenforced.py; llguidance's are here. They were
measured, not read from documentation: a small schema per keyword was compiled with
llguidance 1.9.1 and a document violating only that keyword was fed to the matcher
(tests/unit/schemas/test_guarantees.py keeps them honest). llguidance compiles in `lenient`
mode with `coerce_one_of` and *says* what it weakened in its grammar warnings, without
pointers; `llguidance_unenforced` walks the schema for pointers and then reconciles with
those warnings, adding a pointer-less entry for anything the walk missed, so nothing
llguidance weakened goes unreported.
"""
from __future__ import annotations

import json
import re
from typing import Callable, Mapping

from grammar_contract.report import UnenforcedKeyword
from grammar_service.look_around import name_patterns_without_look_around, without_look_around
from grammar_service.schema_walk import iter_subschemas

# --- rules: (subschema) -> [(keyword, reason)] --------------------------------------------
Rule = Callable[[dict], list[tuple[str, str]]]

_NEVER = {
    "not": "a grammar cannot exclude what a subschema matches",
    "if": "conditional subschemas are not compiled",
    "then": "conditional subschemas are not compiled",
    "else": "conditional subschemas are not compiled",
    "dependencies": "presence-dependent requirements are not compiled",
    "dependentRequired": "presence-dependent requirements are not compiled",
    "dependentSchemas": "presence-dependent subschemas are not compiled",
    "contains": "the grammar cannot require that some item matches",
    "minContains": "the grammar cannot count matching items",
    "maxContains": "the grammar cannot count matching items",
    "unevaluatedProperties": "annotation-dependent keywords are not compiled",
}


def _present(schema: dict, table: Mapping[str, str]) -> list[tuple[str, str]]:
    return [(key, reason) for key, reason in table.items() if key in schema]


def _unique_items(schema: dict) -> list[tuple[str, str]]:
    return [("uniqueItems", "the grammar cannot compare array items")] if schema.get("uniqueItems") is True else []


def _types(schema: dict) -> set[str] | None:
    declared = schema.get("type")
    if isinstance(declared, str):
        declared = [declared]
    if not isinstance(declared, list):
        return None
    types = set(declared)
    if types & {"integer", "number"}:
        types |= {"integer", "number"}  # an integer is a number: such branches overlap
    return types


def _one_of(schema: dict) -> list[tuple[str, str]]:
    """oneOf is compiled as anyOf; only branches with pairwise disjoint `type`s are exact."""
    branches = schema.get("oneOf")
    if not isinstance(branches, list) or len(branches) < 2:
        return []
    seen: set[str] = set()
    for branch in branches:
        types = _types(branch) if isinstance(branch, dict) else None
        if types is None or types & seen:
            return [("oneOf", "compiled as anyOf: a document matching several branches is not excluded")]
        seen |= types
    return []


def _formats(supported: frozenset[str]) -> Rule:
    def rule(schema: dict) -> list[tuple[str, str]]:
        fmt = schema.get("format")
        if isinstance(fmt, str) and fmt not in supported:
            return [("format", f"format {fmt!r} is not compiled into the grammar")]
        return []
    return rule


def _llg_min_max_properties(schema: dict) -> list[tuple[str, str]]:
    """Measured: with optional listed properties and open additionalProperties, llguidance
    counts only the unlisted ones (it lets {"a":1,"b":2} past maxProperties 1, and refuses
    the valid {"a":1} under minProperties 1)."""
    names = set((schema.get("properties") or {}).keys())
    if names <= set(schema.get("required") or ()) or schema.get("additionalProperties") is False:
        return []
    return [(k, "property counts are checked only over unlisted properties unless every listed "
             "property is required or additionalProperties is false")
            for k in ("minProperties", "maxProperties") if k in schema]


def _look_around(schema: dict) -> list[tuple[str, str]]:
    found = []
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and without_look_around(pattern) != pattern:
        found.append(("pattern", "look-around assertions are dropped from the pattern: a string they "
                      "exclude is let through"))
    additional = schema.get("additionalProperties")
    if name_patterns_without_look_around(schema) and (additional is False or (isinstance(additional, dict)
                                                                             and additional)):
        found.append(("patternProperties", "look-around assertions are dropped from a name pattern: a "
                      "property name they exclude is held to the pattern's schema, not to additionalProperties"))
    return found


LLGUIDANCE_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6",
                                "uri", "uuid"})

LLGUIDANCE_RULES: tuple[Rule, ...] = (
    lambda s: _present(s, {**_NEVER, "propertyNames": "property names are not constrained",
                           "unevaluatedItems": "annotation-dependent keywords are not compiled"}),
    _unique_items, _one_of, _formats(LLGUIDANCE_FORMATS), _llg_min_max_properties, _look_around,
)


def walk_unenforced(schema: dict, rules: tuple[Rule, ...] = LLGUIDANCE_RULES) -> tuple[UnenforcedKeyword, ...]:
    """Keywords the rules flag, in document order, with RFC 6901 pointers."""
    found: list[UnenforcedKeyword] = []
    for pointer, subschema in iter_subschemas(schema):
        for rule in rules:
            found.extend(UnenforcedKeyword(keyword, pointer, reason) for keyword, reason in rule(subschema))
    return tuple(dict.fromkeys(found))


_WARNED_KEYS = re.compile(r'Unimplemented keys: \[([^\]]*)\]')
_WARNED_FORMAT = re.compile(r"Unknown format: (\S+)")


def reconcile_llguidance_warnings(found: tuple[UnenforcedKeyword, ...],
                                  warnings: list[str]) -> tuple[UnenforcedKeyword, ...]:
    """Make the walk agree with what llguidance says it weakened.

    Adds a pointer-less entry for any keyword llguidance warned about that the walk missed
    (never silently weaker), and drops `oneOf` entries when llguidance proved every oneOf
    exact (no oneOf warning).
    """
    warned: set[str] = set()
    for line in warnings:
        for group in _WARNED_KEYS.findall(line):
            warned.update(key.strip().strip('"') for key in group.split(","))
        if _WARNED_FORMAT.search(line):
            warned.add("format")
        if "oneOf" in line:
            warned.add("oneOf")
        if "min/maxProperties" in line:
            warned.add("minProperties")
    # Entries of a kind llguidance did not warn about were proven exact by llguidance.
    conditional = {"oneOf": "oneOf", "minProperties": "minProperties", "maxProperties": "minProperties"}
    result = [u for u in found if conditional.get(u.keyword, "") in warned or u.keyword not in conditional]
    reported = {u.keyword for u in result}
    if reported & {"maxProperties"}:
        reported.add("minProperties")  # llguidance's warning names both as one
    for key in sorted(warned - reported):
        result.append(UnenforcedKeyword(key, "", "llguidance reports it as not enforced (location unknown)"))
    return tuple(result)


def llguidance_report(schema_text: str, options: dict) -> tuple[str, tuple[UnenforcedKeyword, ...]]:
    """(compile error or "", unenforced keywords) of a JSON Schema under llguidance.

    Costs about what a compile costs without the tokenizer (ms); no matcher is built. The
    walk reads `schema_text`; llguidance compiles it rewritten into forms it takes, which move
    no pointer (backends/llguidance_schema.py).
    """
    import llguidance as llg

    from grammar_service.backends.llguidance_schema import for_llguidance

    try:
        schema = json.loads(schema_text)
        grammar = llg.LLMatcher.grammar_from_json_schema(for_llguidance(schema_text), defaults=options)
    except ValueError as exc:
        return f"json_schema: {exc}", ()
    found = walk_unenforced(schema) if isinstance(schema, dict) else ()
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return f"json_schema: {messages[0] if messages else 'llguidance rejected the schema'}", found
    return "", reconcile_llguidance_warnings(found, messages)


def llguidance_unenforced(schema_text: str, options: dict) -> tuple[UnenforcedKeyword, ...]:
    return llguidance_report(schema_text, options)[1]
