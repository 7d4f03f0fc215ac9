"""A JSON Schema checked against its draft's meta-schema before any compile.

A malformed schema (`{"properties": 5}`, `{"maxItems": "x"}`) is refused with the JSON pointer
of the first place its meta-schema fails, instead of reaching a backend (which may take it,
refuse it with a message about its own internals, or crash its compile worker). The draft is
the schema's `$schema` however spelled (structgen/schema_draft_uri.py), 2020-12 when absent or
of no draft, as the final validation of outputs reads it (structgen/schema_validation.py).

jsonschema-rs checks in well under a millisecond what the jsonschema package takes 0.1-0.3 s
for on large schemas (CityJSON, 284 kB: 0.6 ms against 0.3 s; the 2019-09 / 2020-12
meta-schemas go through `$dynamicRef` there), so the check costs the compile nothing. Draft 3,
which it does not know, goes through jsonschema.
"""
from __future__ import annotations

import functools
import json

import jsonschema
import jsonschema_rs

from grammar_service.backends.base import GrammarCompileError
from structgen.schema_draft_uri import draft_of

# each draft's meta-schema checker: jsonschema-rs over the jsonschema package's copy of it, formats
# not asserted (as the final validation does not assert them on schemas: real schemas hold
# `$ref`s with "<" and patterns of other regex dialects that their tools take)
_CHECKERS = {"draft-04": (jsonschema_rs.Draft4Validator, jsonschema.Draft4Validator),
             "draft-06": (jsonschema_rs.Draft6Validator, jsonschema.Draft6Validator),
             "draft-07": (jsonschema_rs.Draft7Validator, jsonschema.Draft7Validator),
             "2019-09": (jsonschema_rs.Draft201909Validator, jsonschema.Draft201909Validator),
             "2020-12": (jsonschema_rs.Draft202012Validator, jsonschema.Draft202012Validator)}
_NAMES = {"draft-04": "draft-04", "draft-06": "draft-06", "draft-07": "draft-07", "2019-09": "draft 2019-09",
          "2020-12": "draft 2020-12", "draft-03": "draft-03"}


def check_schema(text: str) -> None:
    """Raises GrammarCompileError naming the first place where the schema breaks its meta-schema."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        return  # the backend reports malformed JSON (with its position)
    if not isinstance(schema, (dict, bool)):
        raise GrammarCompileError(f"json_schema: a schema is an object or a boolean, not {type(schema).__name__}")
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    draft = (draft_of(uri) if isinstance(uri, str) else None) or "2020-12"
    found = _draft_3_fault(schema) if draft == "draft-03" else _fault(schema, draft)
    if found is not None:
        path, message = found
        pointer = "".join(f"/{str(p).replace('~', '~0').replace('/', '~1')}" for p in path)
        raise GrammarCompileError(f"json_schema: the schema breaks its draft's meta-schema ({_NAMES[draft]}) "
                                  f"at {pointer or '/'}: {_short(message)}")


@functools.lru_cache(maxsize=None)
def _checker(draft: str):
    fast, slow = _CHECKERS[draft]
    return fast(slow.META_SCHEMA, validate_formats=False)


def _fault(schema, draft: str) -> tuple[list, str] | None:
    try:
        _checker(draft).validate(schema)
    except jsonschema_rs.ValidationError as error:
        return list(error.instance_path), error.message
    return None


def _draft_3_fault(schema) -> tuple[list, str] | None:
    return _python_fault(schema, jsonschema.Draft3Validator)


def _python_fault(schema, cls) -> tuple[list, str] | None:
    error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    return None if error is None else (list(error.absolute_path), error.message)


def _short(message: str, limit: int = 300) -> str:
    return message if len(message) <= limit else message[:limit] + "..."
