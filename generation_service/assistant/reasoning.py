"""The reasoning span: the model's markers, a request's reasoning options, the span.

Markers come from the request or from the model: a known pair (`<think>` / `</think>`) that
the tokenizer has as tokens or the chat template writes. What the template writes after the
end marker (Qwen3: "\\n\\n") is the span's separator, read by rendering a turn with
`enable_thinking` false. A template that opens the span itself (the prompt ends with the
begin marker) makes the output start inside it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from grammar_contract.spec import ReasoningSpan

KNOWN_MARKERS = (("<think>", "</think>"),)  # Qwen3, QwQ, DeepSeek-R1 and the models distilled from it
ReasoningMode = Literal["default", "enabled", "disabled"]
MAX_MARKER_CHARS = 64  # markers are delimiters; each becomes a literal of the span grammar and a parser hold-back
MAX_BUDGET_TOKENS = (1 << 31) - 1  # xgrammar's any_text max_tokens is a signed 32-bit count


@dataclass(frozen=True)
class ReasoningMarkers:
    begin: str
    end: str
    separator: str = ""  # what the chat template writes after the end marker


@dataclass(frozen=True)
class ReasoningRequest:
    """A request's reasoning options, as both API fronts take them."""

    mode: ReasoningMode = "default"   # default: the chat template's own, no span
    max_tokens: int | None = None     # budget of the span; then the end marker is forced
    begin: str = ""                   # markers; empty: the model's
    end: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ("default", "enabled", "disabled"):
            raise ValueError(f"reasoning mode must be default, enabled or disabled, got {self.mode!r}")
        if self.mode != "enabled" and (self.max_tokens is not None or self.begin or self.end):
            raise ValueError("reasoning max_tokens and markers need reasoning enabled")
        if bool(self.begin) != bool(self.end):
            raise ValueError("reasoning markers come in pairs: give both begin_marker and end_marker, or neither")
        if self.max_tokens is not None and not 0 <= self.max_tokens <= MAX_BUDGET_TOKENS:
            raise ValueError(f"reasoning max_tokens must be 0 to {MAX_BUDGET_TOKENS} (unset: no budget), "
                             f"got {self.max_tokens}")
        if max(len(self.begin), len(self.end)) > MAX_MARKER_CHARS:
            raise ValueError(f"reasoning markers are at most {MAX_MARKER_CHARS} characters")

    @property
    def enable_thinking(self) -> bool | None:
        """The chat template's `enable_thinking`; None leaves it to the template."""
        return {"enabled": True, "disabled": False}.get(self.mode)


@functools.lru_cache(maxsize=16)
def model_markers(tokenizer) -> ReasoningMarkers | None:
    """The served model's reasoning markers, or None when it shows none."""
    template = tokenizer.chat_template or ""
    for begin, end in KNOWN_MARKERS:
        has_tokens = tokenizer.token_id(begin) is not None and tokenizer.token_id(end) is not None
        if has_tokens or (begin in template and end in template):
            return ReasoningMarkers(begin, end, _template_separator(tokenizer, end))
    return None


def _template_separator(tokenizer, end: str) -> str:
    """The whitespace after `end` in a generation prompt rendered with enable_thinking false."""
    if "enable_thinking" not in (tokenizer.chat_template or ""):
        return ""
    try:
        text = tokenizer.render_chat([{"role": "user", "content": "?"}], template_kwargs={"enable_thinking": False})
    except Exception:  # noqa: BLE001 -- a template that cannot render this turn has no separator to read
        return ""
    tail = text[text.rfind(end) + len(end):] if end in text else ""
    return tail if tail and not tail.strip() else ""


def reasoning_span(request: ReasoningRequest, markers: ReasoningMarkers | None, prompt_tail: str) -> ReasoningSpan | None:
    """The span of an enabled request (None otherwise); `prompt_tail`: the prompt's last text,
    which tells whether the template opened the span already. Raises ValueError when the
    request gives no markers and the model has none."""
    if request.mode != "enabled":
        return None
    if request.begin:
        same = markers is not None and (markers.begin, markers.end) == (request.begin, request.end)
        markers = ReasoningMarkers(request.begin, request.end, markers.separator if same else "")
    if markers is None:
        raise ValueError("reasoning: this model shows no reasoning markers (no <think> tokens or template); "
                         "give begin_marker and end_marker")
    starts_open = prompt_tail.rstrip().endswith(markers.begin)
    return ReasoningSpan(begin=markers.begin, end=markers.end, separator=markers.separator,
                         max_tokens=request.max_tokens, starts_open=starts_open)
