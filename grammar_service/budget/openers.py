"""What opens something new in a structural tag's text, beside JSON's own openers.

Near its budget a row writes only tokens that open nothing new (rows.py), judged by JSON's
punctuation. A tool-call grammar also opens another call with text that is not JSON: a trigger
(`<tool_call>`) or a separator between calls (`; `, a newline). The first character of each is
avoided near the budget as `{` is: a token holding one can commit the row to a whole call more
than the budget has room for. A tag's begin is not: where a tag is due it is the way out, and
where it is optional a trigger or separator comes first.
"""
from __future__ import annotations

import json

from grammar_contract.spec import GrammarSpec


def opening_characters(spec: GrammarSpec) -> frozenset[str]:
    """The first characters of the triggers and separators of a structural tag spec (none for
    other kinds, or text that is not JSON)."""
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
            if isinstance(separator := node.get("separator"), str) and separator:
                found.add(separator[0])
            found.update(t[0] for t in node.get("triggers", ()) if isinstance(t, str) and t)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return frozenset(found)
