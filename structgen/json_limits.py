"""JSON text from users, parsed with a nesting limit both processes apply.

`json.loads` raises RecursionError past about a thousand levels, and every walker after it
(the schema converters in C++ and Rust, grammar_service.guarantees, jsonschema) recurses per
level too. A document nested deeper than MAX_JSON_DEPTH is refused with a message naming the
limit; no real-world schema of the corpus (benchmarks/corpus.py) comes near it.
"""
from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 128  # arrays and objects, counted from the outermost


class JsonDepthError(ValueError):
    """The JSON nests deeper than MAX_JSON_DEPTH."""


def json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:  # deeper is refused anyway: stop counting there
            todo.extend((child, depth + 1) for child in children)
    return deepest


def loads_limited(text: str, field: str) -> Any:
    """json.loads(text) or ValueError (JSONDecodeError, JsonDepthError) naming `field`."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonDepthError(f"{field} nests deeper than the limit of {MAX_JSON_DEPTH} levels "
                             "(max_json_depth)") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{field} is not valid JSON: {error}") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise JsonDepthError(f"{field} nests deeper than the limit of {MAX_JSON_DEPTH} levels (max_json_depth)")
    return value
