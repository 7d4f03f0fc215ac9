"""OutputProcessor: accepted tokens of one request -> what is streamed, and when it stops.

Stop conditions, in the order tokens arrive: a stop token (EOS unless ignore_eos, or a
stop_token_id; for a constrained request EOS means the grammar completed), max_new_tokens,
then stop strings. Stop strings are never streamed past: text that could still become the
start of a stop string is held back until it cannot, and the match itself is not returned.
"""
from __future__ import annotations

from dataclasses import dataclass

from generation_service.engine.events import FinishReason, TokenLogprob
from generation_service.engine.request import Request

_STOP_TOKEN, _STOP_STRING = FinishReason.STOP_TOKEN, FinishReason.STOP_STRING
_MAX_TOKENS, _GRAMMAR_COMPLETE = FinishReason.MAX_TOKENS, FinishReason.GRAMMAR_COMPLETE
_BUDGET_CLOSED = FinishReason.BUDGET_CLOSED


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None = None


class OutputProcessor:
    def __init__(self, request: Request, tokenizer=None, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.request = request
        self.stop_strings = request.sampling.stop_strings
        # Last characters a held-back suffix can end in: those of proper stop-string prefixes.
        self._held_back_chars = frozenset(c for stop in self.stop_strings for c in stop[:-1])
        self._stop_last_chars = frozenset(stop[-1] for stop in self.stop_strings)
        self.eos_token_ids = frozenset(eos_token_ids)
        self._is_eos_a_stop = request.is_constrained or not request.sampling.ignore_eos
        # Tokens that stop the request by themselves: one set probe per token, not two.
        self._end_token_ids = request.stop_token_ids | (self.eos_token_ids if self._is_eos_a_stop else frozenset())
        self._is_constrained = request.is_constrained
        self._min_tokens = request.sampling.min_tokens
        self._max_num_tokens = request.num_prompt_tokens + request.max_new_tokens  # len(token_ids) at the limit
        self._detok = None
        if tokenizer is not None:
            from generation_service.model.detokenizer import IncrementalDetokenizer
            self._detok = IncrementalDetokenizer(tokenizer, list(request.spec.prompt_ids),
                                                 skip_special_tokens=request.spec.skip_special_tokens)
        self._pending = ""  # decoded text held back: it may be the start of a stop string

    def process(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> Delta:
        """Append accepted tokens to the request, one at a time, up to the first stop."""
        if len(token_ids) == 1:  # a decode row's one token (most rows)
            token = token_ids[0]
            return self.render(token, logprobs, self.accept(token))
        kept, texts, reason = [], [], None
        for token in token_ids:
            kept.append(token)
            reason = self.accept(token)
            text, reason = self._render(token, reason)
            texts.append(text)
            if reason is not None:
                break
        return Delta(kept, "".join(texts), logprobs[:len(kept)], reason)

    def accept(self, token: int) -> FinishReason | None:
        """Append one token to the request (what the scheduler needs of it); the stop it makes
        by itself (a stop token, max_new_tokens), or None. `render` then gives its text."""
        token_ids = self.request.token_ids
        token_ids.append(token)
        if token in self._end_token_ids:
            if not self._is_constrained or token not in self.eos_token_ids:
                return _STOP_TOKEN
            return _BUDGET_CLOSED if self.request.is_budget_closed else _GRAMMAR_COMPLETE
        if len(token_ids) >= self._max_num_tokens:  # num_generated >= max_new_tokens
            return _MAX_TOKENS
        return None

    def render(self, token: int, logprobs: list[TokenLogprob], reason: FinishReason | None = None) -> Delta:
        """The delta of a token `accept` took, given the stop it returned: its text, and
        STOP_STRING if a stop string ends in it. Called before the next `accept` (the
        detokenizer's order)."""
        text, reason = self._render(token, reason)
        return Delta([token], text, logprobs[:1], reason)

    def _render(self, token: int, reason: FinishReason | None) -> tuple[str, FinishReason | None]:
        is_text = reason is None or reason not in (_STOP_TOKEN, _GRAMMAR_COMPLETE, _BUDGET_CLOSED)
        text, is_string_stop = self._text([token] if is_text else [], reason is not None)
        return text, _STOP_STRING if is_string_stop else reason

    def _text(self, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """(text to stream now, whether a stop string matched)."""
        detok = self._detok
        if detok is None:
            return "", False
        text = detok.push(token_ids)
        if final:
            text += detok.flush()
        # min_tokens: no stop string ends the output inside its first min_tokens tokens (as vLLM)
        is_searched = self.stop_strings and self.request.num_generated > self._min_tokens
        return self._hold_back(text, final) if is_searched else (text, False)

    def _hold_back(self, text: str, final: bool) -> tuple[str, bool]:
        """Cut the pending text at a stop string, or stream it but what may still become one."""
        pending = self._pending + text
        # The pending text held no stop string, so a match ends in `text` (most tokens: none).
        cut = None if self._stop_last_chars.isdisjoint(text) else self._find_stop(pending)
        if cut is not None:
            self._pending = ""
            return pending[:cut], True
        split = len(pending) if final else len(pending) - self._held_back_len(pending)
        self._pending = pending[split:]
        return pending[:split], False

    def flush(self) -> str:
        """Text still held back when the request ends for another reason (cancel, error)."""
        text, self._pending = self._pending, ""
        return text

    def _find_stop(self, pending: str) -> int | None:
        hits = [i for stop in self.stop_strings if (i := pending.find(stop)) >= 0]
        return min(hits) if hits else None

    def _held_back_len(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop string."""
        if not pending or pending[-1] not in self._held_back_chars:
            return 0  # (most tokens)
        best = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(pending)), best, -1):
                if pending.endswith(stop[:n]):
                    best = n
                    break
        return best
