"""What a caller asks of the engine: sampling, stop conditions, constraint, speculation.

Frozen dataclasses validated in __post_init__; the gRPC servicer builds them from the proto
and maps `ValueError` to INVALID_ARGUMENT with the message unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

GrammarKind = Literal["json_schema", "regex", "lark", "structural_tag", "json_object", "choice"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "regex", "lark", "structural_tag", "json_object", "choice")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    seed: int | None = None           # same seed + same request = same output, whatever the batch
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # never streamed past; the match itself is not returned
    ignore_eos: bool = False
    num_logprobs: int = 0             # top-n logprobs per generated token, 0 = none

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.num_logprobs <= 20:
            raise ValueError(f"num_logprobs must be in [0, 20], got {self.num_logprobs}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not contain an empty string")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_filters(self) -> bool:
        """top-k or top-p act (they never do when greedy)."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0)


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
    any_whitespace: bool = True        # False: compact separators, no free whitespace
    max_whitespace: int | None = None  # cap on consecutive whitespace where allowed
    strict: bool = False               # refuse schemas with keywords the grammar cannot enforce
    backend: str = "auto"              # "auto", "xgrammar", "llguidance"
    reasoning: ReasoningSpan | None = None  # free text before the constraint (ReasoningSpan)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; expected one of {GRAMMAR_KINDS}")
        if self.kind == "choice" and not self.choices:
            raise ValueError("a choice constraint needs at least one choice")
        if self.kind not in ("choice", "json_object") and not self.text:
            raise ValueError(f"a {self.kind} constraint needs non-empty text")
        if self.max_whitespace is not None and self.max_whitespace < 0:
            raise ValueError(f"max_whitespace must be >= 0, got {self.max_whitespace}")


@dataclass(frozen=True)
class SpeculativeParams:
    num_draft_tokens: int = 0  # 0 = no speculation for this request
    proposer: str = "ngram"    # "ngram" (prompt lookup) or "grammar" (tokens the grammar forces)

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    grammar: GrammarSpec | None = None
    speculative: SpeculativeParams = field(default_factory=SpeculativeParams)
    deadline: float | None = None         # time.monotonic() after which the request fails
    # False: special tokens stay in the streamed text (a tool-call format whose marker is one,
    # such as Mistral's [TOOL_CALLS], is parsed from the text)
    skip_special_tokens: bool = True
    trace_context: dict[str, str] | None = None  # W3C traceparent etc., for spans in the engine

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty: give prompt text, token ids or chat messages")

    @property
    def is_constrained(self) -> bool:
        return self.grammar is not None
