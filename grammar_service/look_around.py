"""Look-around groups out of a regex: what llguidance's regex engine refuses in a `pattern` and
in a `patternProperties` name. Also a literal brace, which it refuses unescaped (`\\${.*\\}`)
where ECMA-262 reads a `{` that starts no quantifier as text: escaped, the same language.

An assertion only narrows a match, so a pattern without its look-around groups matches every
string the pattern matches, and those the assertions excluded: a weakening, which the guarantee
report names (grammar_service/guarantees.py) where llguidance compiles the pattern without them
(grammar_service/backends/llguidance_schema.py).
"""
from __future__ import annotations

import re

from grammar_service.excluded_names import without_exclusion

_LOOK_AROUND = ("(?=", "(?!", "(?<=", "(?<!")


def _class_end(pattern: str, i: int) -> int:
    """Index after the character class that opens at pattern[i] ("[")."""
    i += 1
    i += pattern[i:i + 1] == "^"
    i += pattern[i:i + 1] == "]"  # a "]" first in the class is literal
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _group_end(pattern: str, i: int) -> int | None:
    """Index after the group that opens at pattern[i] ("("); None when it never closes."""
    depth = 0
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
            continue
        if pattern[i] == "[":
            i = _class_end(pattern, i)
            continue
        depth += {"(": 1, ")": -1}.get(pattern[i], 0)
        i += 1
        if depth == 0:
            return i
    return None


def _verbatim_end(pattern: str, i: int) -> int | None:
    """Where the escape or character class at `i` ends (a rewrite copies it whole); None elsewhere."""
    if pattern[i] == "\\":
        return i + 2
    if pattern[i] == "[":
        return _class_end(pattern, i)
    return None


def without_look_around(pattern: str) -> str:
    """`pattern` without its look-around groups (module doc); unchanged when one does not close
    or is quantified (the compile then refuses it as before)."""
    out, i = [], 0
    while i < len(pattern):
        if (end := _verbatim_end(pattern, i)) is not None:
            out.append(pattern[i:end])
            i = end
        elif pattern.startswith(_LOOK_AROUND, i):
            end = _group_end(pattern, i)
            if end is None or pattern[end:end + 1] in ("*", "+", "?", "{"):
                return pattern
            i = end
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)


_QUANTIFIER = re.compile(r"\{\d+(,\d*)?\}")


def with_literal_braces(pattern: str) -> str:
    """`pattern` with every `{` that starts no quantifier escaped (module doc)."""
    out, i = [], 0
    while i < len(pattern):
        if (end := _verbatim_end(pattern, i)) is not None:
            out.append(pattern[i:end])
            i = end
        else:
            is_text = pattern[i] == "{" and not _QUANTIFIER.match(pattern, i)
            out.append("\\{" if is_text else pattern[i])
            i += 1
    return "".join(out)


def llguidance_name_patterns(schema: dict) -> dict[str, str]:
    """The `patternProperties` names of one schema object that llguidance takes in another
    spelling ({name: its spelling}): a look-ahead over listed words spelled without it (the same
    names, excluded_names.py), else the name without its look-around where
    `name_patterns_without_look_around` allows."""
    patterns = schema.get("patternProperties")
    if not isinstance(patterns, dict):
        return {}
    found = {name: spelled for name in patterns if (spelled := without_exclusion(name)) is not None}
    for name, stripped in name_patterns_without_look_around(schema).items():
        if name not in found and stripped not in found.values():
            found[name] = stripped
    return found


def name_patterns_without_look_around(schema: dict) -> dict[str, str]:
    """The `patternProperties` names of one schema object that llguidance takes without their
    look-around groups ({name: name without them}), where that is safe for the declared
    properties: none of them matched by the name without its groups and not by the name itself
    (the declared property would take the pattern's schema too). What the names then let
    through are the undeclared names the groups excluded: guarantees.py and restrictions.py
    name it. Judged with Python's `re` (a pattern it cannot read is kept). Names that
    excluded_names.py spells exactly are not among them."""
    patterns = schema.get("patternProperties")
    if not isinstance(patterns, dict):
        return {}
    declared = list(schema["properties"]) if isinstance(schema.get("properties"), dict) else []
    found: dict[str, str] = {}
    for name in patterns:
        stripped = without_look_around(name)
        if stripped == name or stripped in patterns or stripped in found.values() or without_exclusion(name):
            continue
        try:
            original, relaxed = re.compile(name), re.compile(stripped)
        except re.error:
            continue
        if not any(relaxed.search(d) and not original.search(d) for d in declared):
            found[name] = stripped
    return found
