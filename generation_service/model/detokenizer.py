"""IncrementalDetokenizer: token ids in, text deltas out, never half a character.

Decoding single tokens is wrong for SentencePiece (a leading "▁" is a space or nothing
depending on context) and for byte tokens (one UTF-8 character may span several tokens).
So each push decodes a short window of recent ids twice, with and without the unread
tokens, and emits the difference; the window only moves past text that ended cleanly.
If the decoded text ends in U+FFFD the tail is an incomplete character (a partial
byte-fallback or byte-level sequence), and the tokens stay unread until more arrive or
``flush`` is called.

Invariant: the concatenation of all deltas and the flush equals
``decode(prompt_ids + ids)[len(decode(prompt_ids)):]``, which is ``decode(ids)`` without
a prompt. With a prompt, the first generated token keeps its leading space ("▁Hello" ->
" Hello"), as the text continues the prompt.
"""

from __future__ import annotations

from generation_service.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context: enough for any decoder's context rules.
_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])[-_PROMPT_CONTEXT:]
        self._prefix_offset = 0  # window start: decoded text before read_offset is already emitted
        self._read_offset = len(self._ids)  # first id whose text is not emitted yet

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _unread_text(self) -> str:
        """Text of the unread ids, decoded in the context of the window before them."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        return full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else full_text

    def _advance(self) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        # Drop ids left of the window so a long generation does not grow the buffer.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def push(self, token_ids: list[int]) -> str:
        """Text newly completed by ``token_ids`` (may be empty)."""
        self._ids.extend(token_ids)
        text = self._unread_text()
        if not text or text.endswith(_REPLACEMENT):
            return ""
        self._advance()
        return text

    def flush(self) -> str:
        """Everything not yet emitted, incomplete characters included (as U+FFFD)."""
        text = self._unread_text()
        self._advance()
        return text
