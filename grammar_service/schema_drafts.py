"""A JSON Schema as its own draft means it, before a backend compiles it.

Both backends read every schema with 2019-09+ rules. Where an older draft says otherwise the
grammar would refuse valid documents, so the schema is rewritten to the meaning its `$schema`
declares (the final validation, structgen/schema_validation.py, picks the validator by the same
`$schema`):

- Drafts 4, 6 and 7 ignore every keyword beside `$ref` ("All other properties in a "$ref"
  object MUST be ignored"). A `type` or `properties` there would narrow the grammar; llguidance
  also refuses circular references with siblings outright. The siblings are dropped, except
  `definitions` / `$defs` (the targets of JSON pointers, which resolve in the document whatever
  the draft) and the root's `$schema` / `$id` / `id`.

Then `allOf` object branches are folded into their parent where that is exact
(grammar_service/allof_merge.py), so that both backends compile one object.

The draft rewrite only removes keys, so every JSON pointer into its result names the same place
in the original. A folded branch moves: a report entry about what it held points at the parent
that now holds it (`/properties/b`, not `/allOf/1/properties/b`); nothing else moves.
"""
from __future__ import annotations

import functools
import json
import re

from grammar_service.allof_merge import fold_all_of
from grammar_service.schema_walk import iter_subschemas

_SIBLINGS_IGNORED = re.compile(r"^https?://json-schema\.org/draft-0[3-7]/schema#?$")
_KEPT_BESIDE_REF = frozenset({"$ref", "definitions", "$defs"})
_KEPT_AT_ROOT = frozenset({"$schema", "$id", "id"})
_MAX_CACHED = 64  # choose_backend and the compile read the same text one after the other


def ignores_ref_siblings(schema) -> bool:
    """True when the schema's draft (its `$schema`) ignores the keywords beside `$ref`."""
    return isinstance(schema, dict) and isinstance(schema.get("$schema"), str) and bool(
        _SIBLINGS_IGNORED.match(schema["$schema"].strip()))


def _drop_ref_siblings(schema: dict) -> bool:
    """Removes the ignored siblings of every `$ref` in place, walking schema keywords only
    (a `$ref` key inside a `const` or `default` value is data); True if any was removed."""
    changed = False
    for pointer, node in iter_subschemas(schema):  # a node's children are walked after it
        if isinstance(node.get("$ref"), str):
            kept = _KEPT_BESIDE_REF | (_KEPT_AT_ROOT if pointer == "" else frozenset())
            for key in [k for k in node if k not in kept]:
                del node[key]
                changed = True
    return changed


@functools.lru_cache(maxsize=_MAX_CACHED)
def as_drafted(schema_text: str) -> str:
    """The schema text a backend compiles: `schema_text` itself unless its draft changes what
    it means, or an `allOf` folds (module doc). Malformed JSON is returned as is, for the
    backend to report."""
    drafted = "$ref" in schema_text and "draft-0" in schema_text
    if not drafted and "allOf" not in schema_text:
        return schema_text
    try:
        schema = json.loads(schema_text)
    except (ValueError, RecursionError):
        return schema_text
    dropped = drafted and ignores_ref_siblings(schema) and _drop_ref_siblings(schema)
    folded = "allOf" in schema_text and fold_all_of(schema)
    if not dropped and not folded:
        return schema_text
    return json.dumps(schema, ensure_ascii=False)
