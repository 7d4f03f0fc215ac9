"""TurnParser: the streamed text of one turn split into reasoning, content and tool calls.

Text arrives in arbitrary pieces; anything that may still turn out to be a marker (the
span's end, a call's trigger) is held back until it is known, so no piece ever carries half a
marker. `finish` returns what is still held: a partial trigger as content, a call cut off
by max_tokens as the turn's incomplete call (neither a call nor content).

The span ends where the grammar ends it: at the end marker's token when the marker is one
added token (the grammar takes it as that token only, so ordinary tokens inside the span may
spell its text: `<`, `/`, `think`, `>`), else at the first occurrence of its text. A call
starts the same way: at the trigger's token when the trigger is one added token (Qwen's
`<tool_call>`: both grammars trigger on that token only, so free text may spell it), else at
the trigger's text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from generation_service.assistant.formats import ToolCallFormat
from generation_service.assistant.tools import ToolCall, new_call_id
from generation_service.model.detokenizer import IncrementalDetokenizer
from grammar_contract.spec import ReasoningSpan


@dataclass
class TurnPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    incomplete_call: str = ""  # the final piece's: a call's text that the output's end cut short


def held_back_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class EndToken:
    """Where the end marker's token ends in the streamed text: the output's tokens go through a
    detokenizer of their own, as the engine's (same prompt context and special-token rule, so
    the same text), until that token comes; then it costs nothing more."""

    def __init__(self, token_id: int, tokenizer, prompt_ids: tuple[int, ...], skip_special_tokens: bool) -> None:
        self.token_id = token_id
        self._detok = IncrementalDetokenizer(tokenizer, list(prompt_ids), skip_special_tokens=skip_special_tokens)
        self._text_len = 0
        self.end_offset: int | None = None  # characters of output text up to the token's text included

    def feed(self, token_ids) -> None:
        """The tokens of the next event."""
        if self.end_offset is not None or not token_ids:
            return
        ids = list(token_ids)
        if self.token_id not in ids:
            self._text_len += len(self._detok.push(ids))
            return
        # the token's text is whole (an added token), so no text before it stays held back
        self.end_offset = self._text_len + len(self._detok.push(ids[:ids.index(self.token_id) + 1]))


class TriggerToken:
    """Where each of the tool-call trigger's tokens starts in the streamed text: the output's
    tokens go through a detokenizer of their own, as EndToken's (same text as the engine's)."""

    def __init__(self, token_id: int, text: str, tokenizer, prompt_ids: tuple[int, ...],
                 skip_special_tokens: bool) -> None:
        self.token_id, self._text = token_id, text
        self._detok = IncrementalDetokenizer(tokenizer, list(prompt_ids), skip_special_tokens=skip_special_tokens)
        self._text_len = 0
        self.starts: list[int] = []  # characters of output text before each trigger token's text

    def feed(self, token_ids) -> None:
        """The tokens of the next event."""
        ids, done = list(token_ids), 0
        while self.token_id in ids[done:]:
            upto = ids.index(self.token_id, done) + 1
            # the token's text is whole (an added token), so no text before it stays held back
            self._text_len += len(self._detok.push(ids[done:upto]))
            self.starts.append(self._text_len - len(self._text))
            done = upto
        if done < len(ids):
            self._text_len += len(self._detok.push(ids[done:]))


class ReasoningSplitter:
    """Reasoning is the text between the span's markers (markers left out); content is what
    follows the end marker and its separator. An output that does not open with the begin
    marker (only possible where no grammar enforces the span) is content throughout.
    With `end_token` the span ends at that token, fed with `feed`'s token ids; else at the
    end marker's first text."""

    def __init__(self, span: ReasoningSpan, end_token: EndToken | None = None) -> None:
        self._span = span
        self._end_token = end_token
        self._state = "inside" if span.starts_open else "before"
        self._buffer = ""
        self._num_chars_fed = 0  # the buffer ends there in the output text

    def feed(self, text: str, token_ids=()) -> tuple[str, str]:
        """(reasoning, content) completed by `text` (and its `token_ids`)."""
        if self._end_token is not None:
            self._end_token.feed(token_ids)
        self._buffer += text
        self._num_chars_fed += len(text)
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
            cut = self._end_cut()
            if cut is None:
                keep = self._num_held_back()
                reasoning, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                return reasoning, ""
            end, after = cut
            reasoning, self._buffer = self._buffer[:end], self._buffer[after:]
            self._state = "separator"
        if self._state == "separator":
            separator = self._span.separator
            if separator.startswith(self._buffer) and len(self._buffer) < len(separator):
                return reasoning, ""
            self._buffer = self._buffer.removeprefix(separator)
            self._state = "after"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def _end_cut(self) -> tuple[int, int] | None:
        """(where the end marker starts, where it ends) in the buffer, once it is all there."""
        if self._end_token is None:
            end = self._buffer.find(self._span.end)
            return None if end < 0 else (end, end + len(self._span.end))
        offset = self._end_token.end_offset
        after = None if offset is None else offset - (self._num_chars_fed - len(self._buffer))
        if after is None or after > len(self._buffer):
            return None
        before = self._buffer[:after]
        return len(before.removesuffix(self._span.end)), after

    def _num_held_back(self) -> int:
        """Characters at the buffer's end that may be the end marker's."""
        if self._end_token is None:
            return held_back_len(self._buffer, self._span.end)
        offset = self._end_token.end_offset
        if offset is None:
            return 0  # the token has not come: all of the text so far is reasoning
        return max(0, min(len(self._buffer), self._num_chars_fed - (offset - len(self._span.end))))

    @property
    def num_chars_held(self) -> int:
        """Characters fed and not yet returned (the output text's last ones)."""
        return len(self._buffer)

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        if self._state == "inside":
            return rest, ""
        return "", rest if self._state != "separator" else rest.removeprefix(self._span.separator)


class CallExtractor:
    """Content text in, content text and completed calls out, for one tool-call format.
    With `trigger_token` a call starts only at that token (fed with `feed`'s token ids; the
    content begins at `stream_start` in the output text); else at the trigger's text."""

    def __init__(self, format_: ToolCallFormat, only_calls: bool, trigger_token: TriggerToken | None = None) -> None:
        self._format = format_
        self._only_calls = only_calls  # required / named: text between calls is the separator
        self._trigger_token = trigger_token
        self.stream_start = 0          # where the content text starts in the output text
        self._num_chars_done = 0       # content characters before the buffer
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str, token_ids=()) -> tuple[str, list[ToolCall]]:
        if self._trigger_token is not None:
            self._trigger_token.feed(token_ids)
        self._buffer += text
        content, calls = [], []
        while True:
            if self._in_call:
                region = self._format.parse_region(self._buffer)
                if region is None:
                    break
                length, parsed = region
                if parsed is None:  # not a call after all: it stays text
                    content.append(self._take(length))
                else:
                    self._take(length)
                    calls += [ToolCall(new_call_id(), name, arguments) for name, arguments in parsed]
                self._in_call = False
                continue
            begin, keep = self._next_trigger()
            if begin < 0:
                content.append(self._take(len(self._buffer) - keep))
                break
            content.append(self._take(begin))
            self._in_call = True
        return self._content("".join(content)), calls

    def _take(self, num_chars: int) -> str:
        """The buffer's first `num_chars`, removed."""
        taken, self._buffer = self._buffer[:num_chars], self._buffer[num_chars:]
        self._num_chars_done += num_chars
        return taken

    def _next_trigger(self) -> tuple[int, int]:
        """(where the next call starts in the buffer, else -1; characters at its end that may
        still start one and stay held back)."""
        trigger = self._format.trigger
        if self._trigger_token is None:
            begin = self._buffer.find(trigger)
            return begin, 0 if begin >= 0 else held_back_len(self._buffer, trigger)
        for start in self._trigger_token.starts:
            begin = start - self.stream_start - self._num_chars_done
            if begin >= 0:  # earlier ones: in the reasoning, or inside a call already read
                return (begin, 0) if begin < len(self._buffer) else (-1, 0)
        return -1, 0  # the token has not come: all of the text so far is content

    def finish(self) -> tuple[str, str]:
        """(text still held back as content: a partial trigger; the text of a call cut off).
        Under calls only, whatever is left but separators is a call cut off, trigger or not."""
        rest = self._take(len(self._buffer))
        if self._in_call or (self._only_calls and self._content(rest)):
            self._in_call = False
            return "", rest.lstrip(self._format.separator + " \n")
        return self._content(rest), ""

    def _content(self, text: str) -> str:
        if self._only_calls and not text.replace(self._format.separator.strip() or "\n", "").strip():
            return ""
        return text


class TurnParser:
    """A reasoning splitter (when the turn has a span) feeding a call extractor (when it has tools)."""

    def __init__(self, span: ReasoningSpan | None, calls: CallExtractor | None,
                 end_token: EndToken | None = None) -> None:
        self._splitter = ReasoningSplitter(span, end_token) if span is not None else None
        self._calls = calls
        self._num_chars_fed = 0
        self._has_content = False

    def feed(self, text: str, final: bool = False, token_ids=()) -> TurnPiece:
        """The piece completed by an event's `text`; `token_ids`: the event's tokens (the
        span's end and the calls' starts, when their markers are one token)."""
        piece = TurnPiece()
        self._num_chars_fed += len(text)
        if self._splitter is not None:
            piece.reasoning, text = self._splitter.feed(text, token_ids)
            if final:
                reasoning, rest = self._splitter.finish()
                piece.reasoning, text = piece.reasoning + reasoning, text + rest
            if text and not self._has_content:  # the content is the output text's rest from here
                self._has_content = True
                if self._calls is not None:
                    self._calls.stream_start = self._num_chars_fed - self._splitter.num_chars_held - len(text)
        if self._calls is not None:
            text, piece.calls = self._calls.feed(text, token_ids)
            if final:
                rest, piece.incomplete_call = self._calls.finish()
                text += rest
        piece.content = text
        return piece
