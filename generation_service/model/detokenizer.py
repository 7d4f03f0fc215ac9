"""IncrementalDetokenizer: token ids in, text deltas out, never half a character.

Decoding single tokens is wrong for SentencePiece (a leading "▁" is a space or nothing
depending on context) and for byte tokens (one UTF-8 character may span several tokens).
So each push decodes a short window of recent ids twice, with and without the unread
tokens, and emits the difference; the window only moves past text that ended cleanly.
(In a steady decode the window without the unread tokens is the one token read last, whose
text is memoized per tokenizer: one decode call per token, not two. With a byte-level decoder a
token of whole characters needs none: its memoized text is its delta; and after a delta (which
ends on a whole character) the unread tokens of a split character decode alone, in one call.)
If the decoded text ends in U+FFFD the tail is an incomplete character (a partial
byte-level sequence), and the tokens stay unread until more arrive or ``flush`` is called.
Byte-fallback runs (<0xE2><0x82><0xAC>) are held until a non-byte token ends them: the
`tokenizers` ByteFallback decoder replaces a *whole* run by U+FFFD when any part of it is
invalid, so bytes that decode fine now may still turn into U+FFFD later.

Invariant: the concatenation of all deltas and the flush equals
``decode(prompt_ids + ids)[len(decode(prompt_ids)):]``, which is ``decode(ids)`` without
a prompt. With a prompt, the first generated token keeps its leading space ("▁Hello" ->
" Hello"), as the text continues the prompt.
"""

from __future__ import annotations

import weakref

from generation_service.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context: enough for any decoder's context rules.
_PROMPT_CONTEXT = 6
# decode([id]) per tokenizer and skip_special_tokens: a pure function, and at most one entry
# per vocabulary token. Shared by every detokenizer of the tokenizer: the engine thread's and the
# API fronts' (assistant/parser.py EndToken); a get or set of one key is atomic under the GIL.
_single_token_texts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._byte_ids: frozenset[int] = tokenizer.byte_fallback_ids
        # Skipped specials vanish from the text, so byte runs join across them.
        self._skipped_ids: frozenset[int] = (tokenizer.special_token_ids if self._byte_ids and skip_special_tokens
                                             else frozenset())
        texts = _single_token_texts.setdefault(tokenizer, {})
        self._token_texts: dict[int, str] = texts.setdefault(skip_special_tokens, {})
        self._concatenates = tokenizer.decodes_by_concatenation
        self._ids: list[int] = list(prompt_ids or [])[-_PROMPT_CONTEXT:]
        self._prefix_offset = 0  # window start: decoded text before read_offset is already emitted
        self._read_offset = len(self._ids)  # first id whose text is not emitted yet
        # A concatenating decoder's text before the unread ids ended on a whole character (a
        # delta was emitted): their text is their own decode, the window's is not needed.
        self._is_prefix_whole = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._decode([token_id])
        return text

    def _prefix_text(self) -> str:
        """Text of the window before the unread ids."""
        if self._read_offset - self._prefix_offset != 1:
            return self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._token_text(self._ids[self._prefix_offset])

    def _unread_text(self) -> str:
        """Text of the unread ids, decoded in the context of the window before them."""
        if self._concatenates:
            # A byte-level decoder concatenates bytes, and UTF-8 resynchronises at a lead byte: one
            # unread token of whole characters is its own text, whatever precedes it; after a
            # whole character, so are any unread tokens, broken characters and all.
            num_unread = len(self._ids) - self._read_offset
            if num_unread == 1:
                text = self._token_text(self._ids[-1])
                if self._is_prefix_whole or _REPLACEMENT not in text:
                    return text
            elif self._is_prefix_whole:
                return self._decode(self._ids[self._read_offset :])
        prefix_text = self._prefix_text()
        full_text = self._decode(self._ids[self._prefix_offset :])
        return full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else full_text

    def _advance(self) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        # Drop ids left of the window so a long generation does not grow the buffer.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _ends_in_byte_run(self) -> bool:
        if not self._byte_ids:
            return False
        ids = self._ids
        for i in range(len(ids) - 1, self._read_offset - 1, -1):  # (no copy: most pushes stop at the last id)
            if ids[i] not in self._skipped_ids:
                return ids[i] in self._byte_ids
        return False

    def push(self, token_ids: list[int]) -> str:
        """Text newly completed by ``token_ids`` (may be empty)."""
        self._ids.extend(token_ids)
        if self._ends_in_byte_run():
            return ""
        text = self._unread_text()
        if not text or text.endswith(_REPLACEMENT):
            return ""
        self._advance()
        self._is_prefix_whole = True
        return text

    def flush(self) -> str:
        """Everything not yet emitted, incomplete characters included (as U+FFFD)."""
        text = self._unread_text()
        self._advance()
        self._is_prefix_whole = False  # (it may end in a broken character)
        return text
