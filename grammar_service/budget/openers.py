"""What opens something new in a structural tag's text, beside JSON's own openers.

Near its budget a row writes only tokens that open nothing new (rows.py), judged by JSON's
punctuation. A tool-call grammar also opens a new call with text that is not JSON: a trigger
(`<tool_call>`), a separator between calls (`; `, a newline) or a tag's begin. The first
character of each is avoided near the budget as `{` is: a token holding one can commit the row
to a whole call more than the budget has room for.
"""
from __future__ import annotations

import json

from grammar_contract.spec import GrammarSpec

_OPENING_KEYS = ("begin", "separator")


def opening_characters(spec: GrammarSpec) -> frozenset[str]:
    """The first characters of the triggers, separators and tag begins of a structural tag
    spec (none for other kinds, or text that is not JSON)."""
    if spec.kind != "structural_tag":
        return frozenset()
    try:
        tree = json.loads(spec.text)
    except ValueError:
        return frozenset()
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.update(node[key][0] for key in _OPENING_KEYS if isinstance(node.get(key), str) and node[key])
            found.update(t[0] for t in node.get("triggers", ()) if isinstance(t, str) and t)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return frozenset(found)
