"""What closing on budget needs of a backend's vocabulary, built once per backend.

`content`: the tokens that only add to the text the grammar is in (a string's characters, a
number's digits) and open nothing: no JSON punctuation, no backslash, not whitespace alone,
not part of a character, not special. Near its budget a row may still write those (they leave the way out as long as
it was), while anything else must be the next token of a known finish.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

from grammar_service.backends.base import GrammarBackend
from grammar_service.budget.closing import ClosingVocab, ClosingWalk

_OPENING = set('{}[],:"\\')


class ClosingTools:
    def __init__(self, backend: GrammarBackend):
        self.vocab = ClosingVocab(backend)
        self.content = self._content_mask(backend)

    def walk(self) -> ClosingWalk:
        """A walk of one's own (it holds mask buffers): one per thread."""
        return ClosingWalk(self.vocab)

    def _content_mask(self, backend: GrammarBackend) -> np.ndarray:
        data = backend.tokenizer
        decode = self.vocab.text_tokenizer.decode
        special = set(data.special_token_ids) | set(backend.stop_token_ids)
        bits = np.zeros(data.mask_words, np.uint32)
        for token, spelled in enumerate(data.encoded_vocab):
            if not spelled or token in special:
                continue
            text = decode([token], skip_special_tokens=False)
            # (U+FFFD: part of a UTF-8 sequence, whose rest would come before any way out)
            if text.strip() and _OPENING.isdisjoint(text) and "\ufffd" not in text:
                bits[token >> 5] |= np.uint32(1 << (token & 31))
        return bits


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
