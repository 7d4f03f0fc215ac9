"""TurnParser: the streamed text of one turn split into reasoning, content and tool calls.

Text arrives in arbitrary pieces; anything that may still turn out to be a marker (the
span's end, a call's trigger) is held back until it is known, so no piece ever carries half a
marker. `finish` returns what is still held (a call cut off by max_tokens is not a call: it
is content).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from generation_service.assistant.formats import ToolCallFormat
from generation_service.assistant.tools import ToolCall, new_call_id
from grammar_contract.spec import ReasoningSpan


@dataclass
class TurnPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def held_back_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Reasoning is the text between the span's markers (markers left out); content is what
    follows the end marker and its separator. An output that does not open with the begin
    marker (only possible where no grammar enforces the span) is content throughout."""

    def __init__(self, span: ReasoningSpan) -> None:
        self._span = span
        self._state = "inside" if span.starts_open else "before"
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) completed by `text`."""
        self._buffer += text
        reasoning = ""
        if self._state == "before":
            head = self._buffer.lstrip()
            if head.startswith(self._span.begin):
                self._buffer, self._state = head[len(self._span.begin):], "inside"
            elif self._span.begin.startswith(head):
                return "", ""
            else:
                self._state = "after"
        if self._state == "inside":
            end = self._buffer.find(self._span.end)
            if end < 0:
                keep = held_back_len(self._buffer, self._span.end)
                reasoning, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:end], self._buffer[end + len(self._span.end):]
            self._state = "separator"
        if self._state == "separator":
            separator = self._span.separator
            if separator.startswith(self._buffer) and len(self._buffer) < len(separator):
                return reasoning, ""
            self._buffer = self._buffer.removeprefix(separator)
            self._state = "after"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        if self._state == "inside":
            return rest, ""
        return "", rest if self._state != "separator" else rest.removeprefix(self._span.separator)


class CallExtractor:
    """Content text in, content text and completed calls out, for one tool-call format."""

    def __init__(self, format_: ToolCallFormat, only_calls: bool) -> None:
        self._format = format_
        self._only_calls = only_calls  # required / named: text between calls is the separator
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        trigger = self._format.trigger
        content, calls = [], []
        while True:
            if self._in_call:
                region = self._format.parse_region(self._buffer)
                if region is None:
                    break
                length, parsed = region
                if parsed is None:  # not a call after all: it stays text
                    content.append(self._buffer[:length])
                else:
                    calls += [ToolCall(new_call_id(), name, arguments) for name, arguments in parsed]
                self._buffer, self._in_call = self._buffer[length:], False
                continue
            begin = self._buffer.find(trigger)
            if begin < 0:
                keep = held_back_len(self._buffer, trigger)
                content.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content.append(self._buffer[:begin])
            self._buffer, self._in_call = self._buffer[begin:], True
        return self._content("".join(content)), calls

    def finish(self) -> str:
        """Text still held back (a partial trigger, or a call cut off), as content."""
        rest, self._buffer, self._in_call = self._buffer, "", False
        return self._content(rest)

    def _content(self, text: str) -> str:
        if self._only_calls and not text.replace(self._format.separator.strip() or "\n", "").strip():
            return ""
        return text


class TurnParser:
    """A reasoning splitter (when the turn has a span) feeding a call extractor (when it has tools)."""

    def __init__(self, span: ReasoningSpan | None, calls: CallExtractor | None) -> None:
        self._splitter = ReasoningSplitter(span) if span is not None else None
        self._calls = calls

    def feed(self, text: str, final: bool = False) -> TurnPiece:
        piece = TurnPiece()
        if self._splitter is not None:
            piece.reasoning, text = self._splitter.feed(text)
            if final:
                reasoning, rest = self._splitter.finish()
                piece.reasoning, text = piece.reasoning + reasoning, text + rest
        if self._calls is not None:
            text, piece.calls = self._calls.feed(text)
            if final:
                text += self._calls.finish()
        piece.content = text
        return piece
