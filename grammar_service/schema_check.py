"""A JSON Schema checked against its draft's meta-schema before any compile.

A malformed schema (`{"properties": 5}`, `{"maxItems": "x"}`) is refused with the JSON pointer
of the first place its meta-schema fails, instead of reaching a backend (which may take it,
refuse it with a message about its own internals, or crash its compile worker). The draft is
the schema's `$schema` however spelled (2020-12 when absent), as the final validation of
outputs reads it (structgen/schema_validation.py `validator_class`).

jsonschema validates the 2019-09 and 2020-12 meta-schemas through `$dynamicRef` /
`$recursiveRef` across their vocabulary files, 100-500x slower than a draft-07 check on large
schemas (k8s-pod-v1, 215 kB: 0.5 s). Here they are flattened once into one document of plain
`$ref`s (nothing extends the vocabularies, so the dynamic references resolve to the root), which
checks the same keywords at draft-07 speed.
"""
from __future__ import annotations

import functools
import json
import re

import jsonschema
from jsonschema_specifications import REGISTRY

from grammar_service.backends.base import GrammarCompileError
from structgen.schema_validation import validator_class

_DYNAMIC_DRAFTS = {
    jsonschema.Draft202012Validator: "https://json-schema.org/draft/2020-12/",
    jsonschema.Draft201909Validator: "https://json-schema.org/draft/2019-09/",
}
_DROPPED = frozenset({"$id", "$schema", "$vocabulary", "$dynamicAnchor", "$recursiveAnchor"})
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_VOCAB_REF = re.compile(r"^(meta/[a-z-]+)?#(/\$defs/(.+))?$")


def check_schema(text: str) -> None:
    """Raises GrammarCompileError naming the first place where the schema breaks its meta-schema."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        return  # the backend reports malformed JSON (with its position)
    if not isinstance(schema, (dict, bool)):
        raise GrammarCompileError(f"json_schema: a schema is an object or a boolean, not {type(schema).__name__}")
    cls = validator_class(schema)
    error = jsonschema.exceptions.best_match(_meta_validator(cls).iter_errors(schema))
    if error is not None:
        pointer = "".join(f"/{str(p).replace('~', '~0').replace('/', '~1')}" for p in error.absolute_path)
        raise GrammarCompileError(f"json_schema: the schema breaks its draft's meta-schema ({_draft_name(cls)}) "
                                  f"at {pointer or '/'}: {_short(error.message)}")


def _short(message: str, limit: int = 300) -> str:
    return message if len(message) <= limit else message[:limit] + "..."


def _draft_name(cls) -> str:
    number = cls.__name__.removeprefix("Draft").removesuffix("Validator")
    return f"draft {number[:4]}-{number[4:]}" if len(number) == 6 else f"draft-0{number}"


@functools.lru_cache(maxsize=None)
def _meta_validator(cls):
    base = _DYNAMIC_DRAFTS.get(cls)
    return cls(cls.META_SCHEMA if base is None else _flattened(base))


def _flattened(base: str) -> dict:
    """The draft's meta-schema in one document: each vocabulary an `allOf` branch, its `$defs`
    moved to the root under "<vocabulary>.<name>", every reference made local."""
    root = REGISTRY.contents(base + "schema")
    defs: dict = {}
    branches = []
    for part in root.get("allOf", []):
        vocabulary = part["$ref"]  # "meta/core", ...
        contents = REGISTRY.contents(base + vocabulary)
        for name, sub in contents.get("$defs", {}).items():
            defs[_def_name(vocabulary, name)] = _local(sub, vocabulary)
        branches.append(_local({k: v for k, v in contents.items() if k != "$defs"}, vocabulary))
    flat = _local({k: v for k, v in root.items() if k != "allOf"}, "")
    flat.update(allOf=branches, **{"$defs": {**flat.get("$defs", {}), **defs}})
    return flat


def _local(node, vocabulary: str):
    """`node` (a schema) with its references into the meta-schema's documents made local to the
    flat one."""
    if isinstance(node, list):
        return [_local(v, vocabulary) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key in ("$dynamicRef", "$recursiveRef"):
            out["$ref"] = "#"  # nothing extends the vocabularies: the root
        elif key == "$ref" and isinstance(value, str) and (found := _VOCAB_REF.match(value)):
            target, name = found.group(1) or vocabulary, found.group(3)
            out["$ref"] = "#" if name is None else f"#/$defs/{_def_name(target, name)}"
        elif key in _NAME_MAPS and isinstance(value, dict):  # names, not keywords
            out[key] = {name: _local(sub, vocabulary) for name, sub in value.items()}
        else:
            out[key] = _local(value, vocabulary)
    return out


def _def_name(vocabulary: str, name: str) -> str:
    return f"{vocabulary.replace('/', '-')}.{name}"
