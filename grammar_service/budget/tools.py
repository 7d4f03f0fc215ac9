"""What closing on budget needs of a backend's vocabulary, built once per backend.

`closing`: the tokens that open nothing new: no "{", "[" or "," (whatever they close or fill).
`content`: of those, the ones that only add to the text the grammar is in (a string's
characters, a number's digits): no JSON punctuation or backslash, not whitespace alone. Neither
holds part of a UTF-8 character (its rest would come before any way out) or a special token.
Near its budget a row may write only closing tokens, then only content (which leaves the way
out as long as it was), besides the next token of a known finish (budget/rows.py).
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

from grammar_service.backends.base import GrammarBackend
from grammar_service.budget.closing import ClosingVocab, ClosingWalk

_PUNCTUATION = set('{}[],:"\\')
_OPENS = set("{[,")  # a new object, array, element or property


class ClosingTools:
    def __init__(self, backend: GrammarBackend):
        self.vocab = ClosingVocab(backend)
        self._tokenizer = backend.tokenizer
        self.content, self.closing = self._masks(backend)
        self._holding: dict[frozenset[str], np.ndarray] = {}
        self._holding_lock = threading.Lock()

    def holding(self, characters: frozenset[str]) -> np.ndarray:
        """The tokens whose text holds any of `characters` (a mask), built once per set (on the
        compile path: budget bindings ask first)."""
        with self._holding_lock:
            mask = self._holding.get(characters)
            if mask is None:
                mask = self._holding[characters] = np.zeros(self._tokenizer.mask_words, np.uint32)
                for token, text in self._texts():
                    if not characters.isdisjoint(text):
                        mask[token >> 5] |= np.uint32(1 << (token & 31))
            return mask

    def walk(self) -> ClosingWalk:
        """A walk of one's own (it holds mask buffers): one per thread."""
        return ClosingWalk(self.vocab)

    def _texts(self):
        """(token, its text) of every token the vocabulary spells."""
        decode = self.vocab.text_tokenizer.decode
        for token, spelled in enumerate(self._tokenizer.encoded_vocab):
            if spelled:
                yield token, decode([token], skip_special_tokens=False)

    def _masks(self, backend: GrammarBackend) -> tuple[np.ndarray, np.ndarray]:
        special = set(self._tokenizer.special_token_ids) | set(backend.stop_token_ids)
        content = np.zeros(self._tokenizer.mask_words, np.uint32)
        closing = np.zeros(self._tokenizer.mask_words, np.uint32)
        for token, text in self._texts():
            if token in special or "\ufffd" in text:
                continue
            bit = np.uint32(1 << (token & 31))
            if _OPENS.isdisjoint(text):
                closing[token >> 5] |= bit
                if text.strip() and _PUNCTUATION.isdisjoint(text):
                    content[token >> 5] |= bit
        return content, closing


_lock = threading.Lock()
_by_backend: "weakref.WeakKeyDictionary[GrammarBackend, ClosingTools]" = weakref.WeakKeyDictionary()


def closing_tools(backend: GrammarBackend) -> ClosingTools:
    """The backend's tools, built on first use (about 0.1 s for a 49k vocabulary on 2 CPUs);
    the compile path asks first, so a step loop never waits on it."""
    with _lock:
        tools = _by_backend.get(backend)
        if tools is None:
            tools = _by_backend[backend] = ClosingTools(backend)
        return tools
