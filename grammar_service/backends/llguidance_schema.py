"""The schema text llguidance compiles: `$schema`, local `$ref`s and patterns in forms it takes.

On the schema_truth corpus, 25 schemas that only xgrammar compiled, some in seconds, compile in
llguidance in milliseconds once rewritten (18 for their references, 7 for their patterns).

llguidance 1.9.1 resolves references through a registry of its own, which refuses two forms
that xgrammar compiles and validators take:

- a `$schema` the registry does not hold ("Resource ... is not present in a registry"): drafts
  3-7 spelled with https, 2019-09 / 2020-12 with http, or a URI of no draft
  (`http://json-schema.org/schema#`). A draft is spelled as the registry spells it; a URI of no
  draft is dropped, so the schema reads as 2020-12, the validators' default. Wherever it appears:
  bundled schemas repeat it in their subschemas.
- a local reference with characters a URI may not hold (`#/$defs/Parameter Node`,
  `#/definitions/TopLevel<Spec>`; "Invalid URI reference" once joined to an `$id`): they are
  percent-encoded, which a resolver decodes back to the same JSON pointer.

Its regex engine also refuses look-around, which a `pattern` uses to exclude names
(`^(?!lucene\\.).*`): the assertions are dropped (grammar_service/look_around.py), which lets
through the strings they excluded, so the guarantee report names it (guarantees.py's
`_look_around`, read on the schema before this rewrite). A look-around in a
`patternProperties` name that excludes listed words (`^(?!python$)[a-z]+$`, "every other
property") is spelled without it, the same names (grammar_service/excluded_names.py); any other
is dropped where no declared property is matched by the name without it and not by the name
itself (that property would take the pattern's schema too:
valid documents refused; the schema is kept, and llguidance refuses it as before): the
undeclared names it excluded then take the pattern's schema, which the report names, as a
weakening where `additionalProperties` constrains them (guarantees.py) and as a restriction
where it does not (restrictions.py).

llguidance refuses `patternProperties` names that overlap; a name whose schema is that of a
name every property matches (".*") says nothing more and is dropped (exact).

The draft a schema is read as is the one grammar_service/schema_drafts.py gave it, and nothing
moves: every JSON pointer into the result names the same place in the schema.
"""
from __future__ import annotations

import functools
import json
from urllib.parse import quote

from grammar_service.backends.llguidance_intersections import untangle
from grammar_service.schema_walk import iter_subschemas
from grammar_service.look_around import llguidance_name_patterns, with_literal_braces, without_look_around
from structgen.schema_draft_uri import draft_of

# what a URI fragment may hold as it is (RFC 3986: pchar / "/" / "?"); "%" keeps an encoding
_FRAGMENT_SAFE = "/?:@!$&'()*+,;=~%"
_MAX_CACHED = 64  # auto's analysis and the compile read the same text one after the other
_MATCH_ALL = frozenset({"", ".*", "^.*", ".*$", "^.*$", "^(.*)$"})  # name patterns every name matches


def _registered(uri: str) -> str | None:
    """`uri` as llguidance's registry spells its draft; None for a URI of no draft."""
    draft = draft_of(uri)
    if draft is None:
        return None
    return f"http://json-schema.org/{draft}/schema#" if draft.startswith("draft-") else \
        f"https://json-schema.org/draft/{draft}/schema"


def _rewrite(schema: dict) -> bool:
    """Rewrites every `$schema`, local `$ref` and `pattern` in place; True if any changed."""
    changed = False
    for _, node in iter_subschemas(schema):
        pattern = node.get("pattern")
        if isinstance(pattern, str) and (kept := with_literal_braces(without_look_around(pattern))) != pattern:
            node["pattern"] = kept
            changed = True
        if names := llguidance_name_patterns(node):
            node["patternProperties"] = {names.get(k, k): v for k, v in node["patternProperties"].items()}
            changed = True
        changed |= _drop_covered_patterns(node)
        changed |= _escape_literal_braces(node)
        uri = node.get("$schema")
        if isinstance(uri, str) and (registered := _registered(uri)) != uri:
            if registered is None:
                del node["$schema"]
            else:
                node["$schema"] = registered
            changed = True
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and (encoded := "#" + quote(ref[1:], _FRAGMENT_SAFE)) != ref:
            node["$ref"] = encoded
            changed = True
    return changed


def _drop_covered_patterns(node: dict) -> bool:
    """Drops the `patternProperties` names whose schema is that of a name matching every
    property (".*"): a property both match takes that one schema either way, and llguidance
    refuses patterns that overlap (Chrome Extension's commands: ".*" and
    "^_execute_browser_action$", both a command). True if any was dropped."""
    patterns = node.get("patternProperties")
    if not isinstance(patterns, dict) or len(patterns) < 2:
        return False
    every = [schema for name, schema in patterns.items() if name in _MATCH_ALL]
    covered = [name for name, schema in patterns.items() if name not in _MATCH_ALL and schema in every]
    for name in covered:
        del patterns[name]
    return bool(covered)


def _escape_literal_braces(node: dict) -> bool:
    """Spells the `patternProperties` names with a literal brace as llguidance reads them
    (look_around.with_literal_braces: the same names); True if any changed."""
    patterns = node.get("patternProperties")
    if not isinstance(patterns, dict):
        return False
    spelled = {with_literal_braces(name): schema for name, schema in patterns.items()}
    if list(spelled) == list(patterns) or len(spelled) < len(patterns):
        return False
    node["patternProperties"] = spelled
    return True


@functools.lru_cache(maxsize=_MAX_CACHED)
def for_llguidance(schema_text: str) -> str:
    """`schema_text` (as grammar_service/schema_drafts.py drafted it) with its `$schema` and
    local references in the forms llguidance resolves (module doc); malformed JSON as is."""
    if not any(mark in schema_text for mark in ("$schema", "$ref", "(?", "pattern", "Of\"")):
        return schema_text
    try:
        schema = json.loads(schema_text)
    except (ValueError, RecursionError):
        return schema_text
    try:
        if not isinstance(schema, dict) or not (_rewrite(schema) | untangle(schema)):
            return schema_text
    except RecursionError:  # nested too deep to walk: the compile says so
        return schema_text
    return json.dumps(schema, ensure_ascii=False)
