"""A short way to finish a document from a matcher's state: a token path to a stop token.

Neither backend says how far its grammar is from an accepting state, so the walk asks the
matcher itself, one step at a time: a run the grammar forces is taken whole; otherwise, of the
one-character tokens the mask allows, the one that brings the JSON syntax closest to its end
(json_syntax.py: close the string, the container, the smallest value; a "," only where
nothing closes). Characters that only fill a string or a number (letters, digits, which the
syntax cannot tell apart) go by the grammar: one after which the mask changes (a pattern moves
on, a minLength is met) before one after which it does not. Text that is not JSON is walked
by that rule alone. Where it gets stuck (a string whose pattern one character at a time cannot
satisfy, no progress for MAX_STALLED steps), it goes back to its latest structural step (a
value's kind, a property) and takes the next token there; otherwise it never goes back, so it is
about as fast as the path is long. It is not always the shortest: an optional property may come
first where the grammar offers it.

The result is a witness: a finish of that many tokens exists from the state, so a budget of
at least that many can always close the document. The walk is bounded (`max_tokens`); past
it there is no witness and the caller leaves the row alone. The path found is spelled again
with the tokenizer's own tokens when the matcher accepts that spelling (fewer tokens).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from grammar_service.backends.base import GrammarBackend, Matcher
from grammar_service.backends.forced_spelling import ForcedSpelling
from grammar_service.budget.json_syntax import ESCAPE, KEY_ESCAPE, JsonState

MAX_TOKENS = 768   # tokens one walk may take before it gives up
MAX_STALLED = 32   # steps in a row that change neither mask nor syntax before it gives up
_ESCAPES = frozenset({ESCAPE, KEY_ESCAPE})
_STRUCTURAL = frozenset({"value", "first", "first_key", "next_key", "after"})
MAX_BACKS = 16  # times a walk goes back to a structural step before it gives up
MAX_SECONDS = 1.0  # a walk gives up after this long (most take 1-10 ms; PocketMine's failed in 3.4 s)
_LOWER = "abcdghijklmopqrsuvwxyz"  # letters with no part in JSON syntax (not t, f, n, e)
_UPPER = "ABCDFGHIJKLMNOPQRSTUVWXYZ"
_CLASSES = (_LOWER, _UPPER, "123456789")  # each tried through its first allowed member
# Among equally short steps: closing ones first, then plain letters (a key or a string the
# grammar spells), then the rest; whitespace last.
_ORDER = ('"', "}", "]", "0", "[", "{", "-", ":", ",", "a", "A", "1", "n", "t", "f", "e", "E", ".", "+")


@dataclass(frozen=True)
class Closing:
    """A finish: `tokens` end with a stop token; `text` is what they spell before it."""

    tokens: tuple[int, ...]
    text: str

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class ClosingVocab:
    """The one-character tokens of a backend's tokenizer, grouped for the walk."""

    def __init__(self, backend: GrammarBackend):
        tokenizer = backend.tokenizer
        self.backend = backend
        self.stop_ids = tuple(sorted(backend.stop_token_ids))
        self.mask_words = tokenizer.mask_words
        # spelled as a model writes text mid-document (no SentencePiece prefix space)
        self._spelling = ForcedSpelling(tokenizer, lambda: ())
        self.text_tokenizer = self._spelling.tokenizer
        by_char: dict[str, int] = {}
        for char in [chr(code) for code in range(32, 127)] + ["\n"]:
            ids = self._spelling.continuation_ids(char)
            if len(ids) == 1:
                by_char[char] = ids[0]
        grouped = set("".join(_CLASSES))
        groups = [tuple((c, by_char[c]) for c in members if c in by_char) for members in _CLASSES]
        groups += [((c, t),) for c, t in by_char.items() if c not in grouped]
        rank = {c: k for k, c in enumerate(_ORDER)}
        first = {group: members[0] for group, members in zip(groups, _CLASSES)}  # (a class by its first)
        self.groups = tuple(sorted((g for g in groups if g), key=lambda g: (
            not g[0][0].strip(), rank.get(first.get(g, g[0][0]), len(rank)))))

    def spell(self, text: str) -> list[int]:
        return self._spelling.continuation_ids(text)

    def text_of(self, token_ids: Sequence[int]) -> str:
        return self.text_tokenizer.decode(list(token_ids), skip_special_tokens=False)


def _moves(state: JsonState | None, after: JsonState | None, char: str) -> bool:
    """Whether a step changes the JSON syntax (an escape in a string and the character after it
    do not: a walk could write \\" forever)."""
    if state is None or after is None or after == state or not (char.strip() or after.mode != state.mode):
        return False
    return not _escapes(state, after)


def _escapes(state: JsonState | None, after: JsonState | None) -> bool:
    return state is not None and after is not None and bool({state.mode, after.mode} & _ESCAPES)


@dataclass
class _Choice:
    """A structural step the walk may come back to, with the tokens it has not tried there."""
    path_len: int
    text: str
    state: JsonState | None
    bits: np.ndarray
    others: list


def _is_structural(state: JsonState | None, text: str) -> bool:
    """A step that picks a value's kind or a property (its key's first character), not a
    string's or a number's next character."""
    return state is not None and (state.mode in _STRUCTURAL or _is_key_start(state, text))


def _is_key_start(state: JsonState | None, text: str) -> bool:
    return state is not None and state.mode == "key" and text.endswith('"')


def _allowed(bits: np.ndarray, token: int) -> bool:
    return bool((int(bits[token >> 5]) >> (token & 31)) & 1)


class ClosingWalk:
    """`find(matcher, json_state)`: a finish from the matcher's state, which it leaves as it was."""

    def __init__(self, vocab: ClosingVocab, max_tokens: int = MAX_TOKENS):
        self.vocab = vocab
        self.max_tokens = max_tokens
        self._masks = np.zeros((2, vocab.mask_words), np.int32)  # the current state's, a candidate's

    def find(self, matcher: Matcher, start: JsonState | None, max_tokens: int | None = None,
             max_seconds: float = MAX_SECONDS) -> Closing | None:
        """`max_tokens`: give up past this many; `max_seconds`: give up after this long."""
        path: list[int] = []
        try:
            found = self._walk(matcher, start, path, min(self.max_tokens, max_tokens or self.max_tokens),
                               time.perf_counter() + max_seconds)
        finally:
            matcher.rollback(len(path))
        return None if found is None else self._respelled(matcher, found)

    def _fill(self, matcher: Matcher, row: int) -> np.ndarray:
        self.vocab.backend.fill_alone(matcher, self._masks, row)
        return self._masks[row].view(np.uint32)

    def _walk(self, matcher: Matcher, state: JsonState | None, path: list[int], max_tokens: int,
              deadline: float) -> Closing | None:
        vocab, text, stalled = self.vocab, "", 0
        choices: list[_Choice] = []  # structural steps with other tokens to try, latest last
        num_back = 0
        bits = self._fill(matcher, 0)
        while time.perf_counter() < deadline:
            if len(path) >= max_tokens or stalled >= MAX_STALLED or bits is None:
                if not choices or num_back == MAX_BACKS:
                    return None
                num_back += 1
                state, text, bits = self._back(matcher, path, choices, state)
                stalled = 0
                continue
            stop = next((t for t in vocab.stop_ids if _allowed(bits, t)), None)
            if stop is not None:
                return Closing((*path, stop), text)
            forced = matcher.jump_forward_tokens()
            if forced:
                accepted = 0
                while accepted < len(forced) and matcher.accept(forced[accepted]):
                    accepted += 1
                path.extend(forced[:accepted])
                if accepted < len(forced):
                    bits = None  # (a forced run the matcher refuses: a backend limit)
                    continue
                piece = vocab.text_of(forced)
                text += piece
                state, stalled = state.push(piece) if state is not None else None, 0  # (None: not JSON)
                bits = self._fill(matcher, 0)
                continue
            chosen = self._step(matcher, bits, state, every=_is_key_start(state, text))
            if chosen is None:
                bits = None
                continue
            (token, piece, next_state, moved), others = chosen
            others = [o for o in others if o[1].strip()]  # (another space never helps)
            if others and _is_structural(state, text):
                choices.append(_Choice(len(path), text, state, bits.copy(), others))
            path.append(token)
            text += piece
            state, stalled = next_state, 0 if moved else stalled + 1
            self._masks[0] = self._masks[1]
            bits = self._masks[0].view(np.uint32)
        return None

    def _back(self, matcher: Matcher, path: list[int], choices: list["_Choice"], stuck: JsonState | None):
        """Back to a structural choice, and on with its next token: (state, text, mask bits),
        bits None when the matcher refuses that token. The choice is the first property of the
        object the walk got stuck in (another property there may pick another branch of an
        anyOf), else the latest one."""
        first = next((k for k, c in enumerate(choices) if stuck is not None and c.state is not None
                      and c.state.stack == stuck.stack and c.state.mode == "key"), None)
        if first is not None:
            del choices[first + 1:]
        choice = choices.pop()
        matcher.rollback(len(path) - choice.path_len)
        del path[choice.path_len:]
        token, char, after = choice.others.pop(0)
        if choice.others:
            choices.append(choice)
        text = choice.text
        if not matcher.accept(token):
            return choice.state, text, None
        path.append(token)
        return after, text + char, self._fill(matcher, 0)
    def _step(self, matcher: Matcher, bits: np.ndarray, state: JsonState | None, every: bool = False):
        """Accepts the best allowed one-character token: ((token, char, next JSON state, whether
        it moved the syntax or the mask), the other candidates); its mask is left in row 1.
        None: nothing allowed."""
        candidates = self._candidates(bits, state, every)
        if not candidates and state is not None:  # the grammar writes what is not JSON here
            state, candidates = None, self._candidates(bits, None)
        if not candidates:  # no one-character token: the rest of a UTF-8 sequence, a special token...
            candidates = [(token, "", state) for token in self._any_allowed(bits)]
        fallback = None
        for k, (token, char, after) in enumerate(candidates):
            if not matcher.accept(token):
                continue
            mask = self._fill(matcher, 1)
            others = candidates[:k] + candidates[k + 1:]
            if _moves(state, after, char):
                return (token, char, after, True), others
            if not np.array_equal(mask, bits) and not _escapes(state, after):  # a pattern, a count met
                return (token, char, after, True), others
            if fallback is None:
                fallback = (token, char, after, self._masks[1].copy(), others)
            matcher.rollback(1)
        if fallback is None:
            return None
        token, char, after, mask, others = fallback
        matcher.accept(token)
        self._masks[1] = mask
        return (token, char, after, False), others

    def _any_allowed(self, bits: np.ndarray, limit: int = 8) -> list[int]:
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
        return [int(t) for t in allowed[:limit] if int(t) not in self.vocab.stop_ids]

    def _candidates(self, bits: np.ndarray, state: JsonState | None,
                    every: bool = False) -> list[tuple[int, str, JsonState | None]]:
        """(token, char, next JSON state) of each group's first allowed member (`every`: of
        every allowed member: a key's first character picks the property), best first:
        whitespace last, then by the characters left to close, then the groups' order."""
        ranked = []
        for order, group in enumerate(self.vocab.groups):
            for char, token in group:
                if _allowed(bits, token):
                    after = state.push(char) if state is not None else None
                    if state is None or after is not None:
                        distance = after.min_chars_to_close if after is not None else 0
                        # whitespace and escapes last: they never shorten the way out
                        ranked.append(((not char.strip() or char == "\\", distance, order), token, char, after))
                    if not every:
                        break
        ranked.sort(key=lambda c: c[0])
        return [c[1:] for c in ranked]

    def _respelled(self, matcher: Matcher, found: Closing) -> Closing:
        """The same text in the tokenizer's own spelling when the matcher takes it (fewer tokens)."""
        ids = self.vocab.spell(found.text)
        if len(ids) + 1 >= len(found.tokens):
            return found
        stop, accepted = found.tokens[-1], 0
        for token in [*ids, stop]:
            if not matcher.accept(token):
                break
            accepted += 1
        matcher.rollback(accepted)
        return Closing((*ids, stop), found.text) if accepted == len(ids) + 1 else found
