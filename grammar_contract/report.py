"""What a compile tells the caller: the grammar's id and the keywords it does not enforce.

grammar_service computes the unenforced and restricted keywords; the control client returns
them in a CompileResult; the engine sends them to the user as a GuaranteeReport before the
first token of a constrained request.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnenforcedKeyword:
    keyword: str   # e.g. "uniqueItems"
    pointer: str   # JSON pointer into the schema, e.g. "/properties/tags"
    reason: str = ""


@dataclass(frozen=True)
class CompileResult:
    """grammar_service's answer to one compile (grammar_contract.client)."""

    grammar_id: int
    backend: str
    compile_ms: float
    cache_hit: bool
    unenforced: tuple[UnenforcedKeyword, ...]
    restricted: tuple[UnenforcedKeyword, ...] = ()
    fallback_from: str = ""   # `auto`'s first pick when `backend` compiled in its place


@dataclass(frozen=True)
class GuaranteeReport:
    """Sent before the first token of a constrained request."""

    backend: str
    unenforced: tuple[UnenforcedKeyword, ...] = ()
    compile_ms: float = 0.0
    cache_hit: bool = False
    # keywords under which the grammar refuses some valid documents (fixed property order...):
    # the output still matches the schema (grammar_service/restrictions.py)
    restricted: tuple[UnenforcedKeyword, ...] = ()
    fallback_from: str = ""   # `auto`'s first pick when `backend` compiled in its place

    @property
    def is_fully_enforced(self) -> bool:
        return not self.unenforced
