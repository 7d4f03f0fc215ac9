"""Which JSON Schema draft a `$schema` URI names, however it is spelled.

Real schemas write the drafts' URIs with http or https, with or without the empty fragment;
jsonschema's and llguidance's registries each know one spelling per draft, so both the final
validation (structgen/schema_validation.py) and the llguidance rewrite
(grammar_service/backends/llguidance_schema.py) read the draft here.
"""
from __future__ import annotations

import re

_OLD_DRAFT = re.compile(r"^https?://json-schema\.org/(draft-0[3-7])/schema#?$")
_NEW_DRAFT = re.compile(r"^https?://json-schema\.org/draft/(2019-09|2020-12)/schema#?$")


def draft_of(uri: str) -> str | None:
    """"draft-03" ... "draft-07", "2019-09" or "2020-12"; None for a URI of no draft."""
    uri = uri.strip()
    if old := _OLD_DRAFT.match(uri):
        return old[1]
    if new := _NEW_DRAFT.match(uri):
        return new[1]
    return None
