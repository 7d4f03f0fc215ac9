"""The constraint a request carries, as the user gave it: what generation_service sends and
grammar_service compiles (cached by content hash). Frozen, validated in __post_init__: a
`ValueError` is the caller's mistake (INVALID_ARGUMENT with the message unchanged)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json_schema", "regex", "lark", "structural_tag", "json_object", "choice"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "regex", "lark", "structural_tag", "json_object", "choice")


@dataclass(frozen=True)
class ReasoningSpan:
    """Free text the model writes before its constraint applies, between two markers.

    The grammar allows anything (but the end marker) after `begin`, then `end`, then
    `separator` (what the chat template writes after the end marker), then the constraint
    from its first token. `max_tokens` caps the free text: once spent, the grammar forces the
    end marker. `starts_open`: the prompt already ends with `begin` (templates that open the
    span themselves), so the output starts inside the span.
    """

    begin: str = "<think>"
    end: str = "</think>"
    separator: str = ""
    max_tokens: int | None = None
    starts_open: bool = False

    def __post_init__(self) -> None:
        if not self.end:
            raise ValueError("a reasoning span needs an end marker")
        if not self.begin and not self.starts_open:
            raise ValueError("a reasoning span needs a begin marker unless the prompt opens it")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"reasoning max_tokens must be >= 0, got {self.max_tokens}")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint as the user gave it; compiled by grammar_service, cached by content hash."""

    kind: GrammarKind
    text: str = ""                     # schema / regex / lark / structural-tag JSON
    choices: tuple[str, ...] = ()      # for kind == "choice"
    any_whitespace: bool = True        # False: fixed separators, no free whitespace
    max_whitespace: int | None = None  # cap on consecutive whitespace where allowed
    single_line: bool = False          # with any_whitespace False: ", " and ": " rather than "," and ":"
    strict: bool = False               # refuse schemas with keywords the grammar cannot enforce
    backend: str = "auto"              # "auto", "xgrammar", "llguidance"
    reasoning: ReasoningSpan | None = None  # free text before the constraint (ReasoningSpan)
    # the request's token budget (its max new tokens): the grammar closes the output within it,
    # and a budget below the grammar's shortest output is refused. Not part of the grammar's
    # cache key: grammar_service binds the compiled grammar to it (grammar_service/budget/).
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; expected one of {GRAMMAR_KINDS}")
        if self.kind == "choice" and not self.choices:
            raise ValueError("a choice constraint needs at least one choice")
        if self.kind not in ("choice", "json_object") and not self.text:
            raise ValueError(f"a {self.kind} constraint needs non-empty text")
        if self.max_whitespace is not None and self.max_whitespace < 0:
            raise ValueError(f"max_whitespace must be >= 0, got {self.max_whitespace}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


def json_layout(*, compact: bool = False, any_whitespace: bool = False,
                max_whitespace: int | None = None) -> dict:
    """The GrammarSpec whitespace fields of an API request's JSON options. By default JSON is
    single-line, as json.dumps writes it (", " and ": ", no other whitespace): ordinary JSON
    on every backend, where free whitespace let models spend their tokens on blank runs.
    `compact`: "," and ":"; `max_whitespace` N: free whitespace, each run at most N
    characters (0: compact); `any_whitespace`: free whitespace, uncapped unless
    `max_whitespace` says. Raises ValueError for options that contradict each other."""
    if compact and (any_whitespace or max_whitespace):
        raise ValueError("compact excludes any_whitespace and max_whitespace > 0")
    if compact or max_whitespace == 0:
        return {"any_whitespace": False, "max_whitespace": max_whitespace, "single_line": False}
    if any_whitespace or max_whitespace is not None:
        return {"any_whitespace": True, "max_whitespace": max_whitespace, "single_line": False}
    return {"any_whitespace": False, "max_whitespace": None, "single_line": True}
