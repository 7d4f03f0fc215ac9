"""Special tokens kept out of xgrammar's text.

xgrammar reads every token of the vocabulary as the text it spells, special tokens included
(Tekken's `[INST]`, `<SPECIAL_12>`...), so a JSON string or a reasoning span may take one.
The detokenizer drops the text of special tokens (skip_special_tokens), so the client would
get other text than the grammar matched: a string shorter than its minLength, or a span whose
end marker only appears once a special token between `</` and `think>` is dropped. llguidance
lexes special tokens apart from text; this gives xgrammar the same rule: a special token is
allowed only where the grammar names it as a token (a `token` element, a trigger token, a
reasoning marker that is one token) or as a stop token.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from grammar_contract.spec import GrammarSpec


class SpecialTokenFilter:
    """Clears special tokens from mask rows: only the mask words that hold one are touched
    (Tekken: 32 of 4096), so a fill costs a small gather more."""

    def __init__(self, special_ids: Iterable[int], always_allowed: Iterable[int], vocab_size: int):
        self.special_ids = frozenset(i for i in special_ids if 0 <= i < vocab_size) - frozenset(always_allowed)
        ids = np.array(sorted(self.special_ids), dtype=np.int64)
        self.word_ids = np.unique(ids // 32)
        keep = np.full(len(self.word_ids), 0xFFFFFFFF, dtype=np.uint32)
        np.bitwise_and.at(keep, np.searchsorted(self.word_ids, ids // 32), ~(np.uint32(1) << (ids % 32).astype(np.uint32)))
        self.keep = keep.view(np.int32)  # per word of word_ids: the bits a grammar naming no special token keeps

    def keep_for(self, named_ids: Iterable[int]) -> np.ndarray:
        """`keep` with the special tokens a grammar names allowed again."""
        named = [i for i in named_ids if i in self.special_ids]
        if not named:
            return self.keep
        keep = self.keep.view(np.uint32).copy()
        for token_id in named:
            keep[np.searchsorted(self.word_ids, token_id // 32)] |= np.uint32(1) << np.uint32(token_id % 32)
        return keep.view(np.int32)

    def allows(self, keep: np.ndarray, token_id: int) -> bool:
        """Whether a grammar with `keep` allows `token_id` as far as special tokens go."""
        if token_id not in self.special_ids:
            return True
        word = int(np.searchsorted(self.word_ids, token_id // 32))
        return bool((int(keep[word]) >> (token_id % 32)) & 1)

    def apply(self, masks: np.ndarray, indices: Sequence[int], keeps: Sequence[np.ndarray]) -> None:
        """Row indices[i] of `masks` &= keeps[i] over the special tokens' words."""
        if not len(self.word_ids):
            return
        rows = np.asarray(indices, dtype=np.int64)[:, None]
        if all(keep is self.keep for keep in keeps):
            masks[rows, self.word_ids] &= self.keep
        else:
            masks[rows, self.word_ids] &= np.stack(keeps)


def named_token_ids(spec: GrammarSpec, token_id: Callable[[str], int | None]) -> set[int]:
    """Ids of the tokens `spec` names as tokens: the reasoning span's markers that are one
    token, and a structural tag's `token` elements and trigger tokens (by id or by text)."""
    named: set[int] = set()
    if spec.reasoning is not None:
        named.update(i for i in (token_id(spec.reasoning.begin), token_id(spec.reasoning.end)) if i is not None)
    if spec.kind == "structural_tag":
        try:
            tag = json.loads(spec.text)
        except ValueError:
            return named  # the compile reports the malformed JSON
        for token in _token_refs(tag):
            found = token if isinstance(token, int) else token_id(token) if isinstance(token, str) else None
            if found is not None:
                named.add(found)
    return named


def _token_refs(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        if node.get("type") == "token":
            yield node.get("token")
        triggers = node.get("trigger_tokens")
        if isinstance(triggers, list):
            yield from triggers
        for value in node.values():
            yield from _token_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _token_refs(value)
