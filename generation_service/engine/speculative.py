"""Speculative decoding: draft proposers and the rules that verify drafts against the model.

A row with k drafts d_0..d_{k-1} is fed [last token, d_0, .., d_{k-1}] in one forward, which
yields k + 1 next-token distributions p_0..p_k (p_i conditions on d_0..d_{i-1}), each after
its own grammar mask row. Verification walks i = 0..k and stops at the first rejection; the
row emits the accepted drafts plus one token drawn by the model (the correction on a
rejection, the bonus p_k when all drafts pass), so every forward yields >= 1 token.
"""
from __future__ import annotations

import abc
from typing import Callable

import numpy as np
import torch

from generation_service.engine.request import Request


class DraftProposer(abc.ABC):
    """Proposes up to k draft tokens that continue a request's `token_ids`.

    Invariant: proposing is a pure function of the request's tokens, the grammar's last
    forced run and the model's weights (the "self" proposer's K/V is that of the request's own
    tokens), so a request that is preempted and resumed gets the same drafts.
    """

    @abc.abstractmethod
    def propose(self, request: Request, k: int) -> list[int]:
        """At most k tokens; [] when there is nothing to propose."""

    def check_ready(self) -> None:
        """Raise InvalidRequestError (naming why) when this proposer cannot draft on this engine;
        checked at submit for each request that asks for it."""


class NgramProposer(DraftProposer):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n = max_ngram down to min_ngram) and propose the k tokens that followed it."""

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3) -> None:
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def propose(self, request: Request, k: int) -> list[int]:
        tokens = request.token_ids
        context = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = context[-n:]
            # starts s of earlier occurrences: context[s:s+n] == tail with s + n < len(context)
            starts = np.flatnonzero(context[:len(tokens) - n] == tail[0])
            for j in range(1, n):
                starts = starts[context[starts + j] == tail[j]]
            if starts.size:  # latest match first: recent text predicts best
                start = int(starts[-1]) + n
                return tokens[start:start + k]
        return []


class GrammarProposer(DraftProposer):
    """Tokens the grammar forces (keys, punctuation, enum tails, `const`), n-gram drafts where
    it forces nothing.

    grammar_service writes, at the mask fill of each step of a request that asks for them
    (FLAG_FORCED_DRAFTS), the run its grammar forces from the step's last exact position
    (`Request.forced_run`, set by lifecycle.py). When the tokens accepted since agree with the
    run, its rest is the drafts: they end where the grammar stops forcing (or at k). Otherwise
    the n-gram proposer drafts, and grammar_service's walk cuts those at the first token the
    grammar rejects (valid_positions). Forced drafts are still only drafts: the forced text may
    be spelled with other tokens than the backend's, so they are verified like any other.
    """

    def __init__(self) -> None:
        self.ngram = NgramProposer()

    def propose(self, request: Request, k: int) -> list[int]:
        run = request.forced_run
        forced = run.after(request.token_ids)[:k] if run is not None else []
        request.num_forced_drafts = len(forced)  # (the row's drafts are read before its next proposal)
        return forced if forced else self.ngram.propose(request, k)


PROPOSERS: dict[str, Callable[[], DraftProposer]] = {"ngram": NgramProposer, "grammar": GrammarProposer}
# Proposers that draft with the model: the engine builds them with its model and KV cache
# (engine/self_drafts.py); here only their names, which requests are checked against.
MODEL_PROPOSERS = ("self",)


def proposer_names() -> list[str]:
    return sorted({*PROPOSERS, *MODEL_PROPOSERS})


def make_proposer(name: str) -> DraftProposer:
    if name not in PROPOSERS:
        raise ValueError(f"unknown draft proposer {name!r}; available: {sorted(PROPOSERS)}"
                         + (" (model proposers are built by the engine)" if name in MODEL_PROPOSERS else ""))
    return PROPOSERS[name]()


# ---- verification ----------------------------------------------------------------------------
def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """Greedy: accept d_i while it equals argmax p_i; then emit argmax at the first mismatch
    (or the bonus argmax p_k). Token-for-token what one-token-at-a-time greedy produces, since
    each accepted draft is exactly the token greedy decoding would have chosen there."""
    out = []
    for i, draft in enumerate(drafts):
        out.append(targets[i])
        if targets[i] != draft:
            return out
    out.append(targets[len(drafts)])
    return out


def sample_from(probs: torch.Tensor, noise: torch.Tensor) -> int:
    """Exponential-race sampling: argmax p / E with E ~ Exp(1) picks index j with prob p_j.
    The noise comes from the request's own generator, so no other row changes the result."""
    return int(torch.argmax(probs / noise))


def accept_rejection(probs: torch.Tensor, drafts: list[int], uniforms: list[float],
                     noises: list[torch.Tensor]) -> list[int]:
    """Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) for a deterministic drafter.

    With draft distribution q and target p, draft d is accepted with prob min(1, p(d)/q(d)),
    and on rejection the token is drawn from the residual normalize(max(p - q, 0)). The
    n-gram proposer is deterministic, so q is a point mass on d: q(d) = 1, q(x != d) = 0:
      accept d  with prob  p(d)                      (u < p(d), u ~ U[0, 1))
      else draw from       normalize(p with p(d) := 0)
    The emitted token then has distribution exactly p:  P(d) = p(d), and for x != d,
    P(x) = (1 - p(d)) * p(x) / (1 - p(d)) = p(x). If every draft passes, the bonus token is
    drawn from p_k. `probs` (k + 1, V) are the processed (masked, tempered, top-k/p) targets.
    """
    out = []
    for i, draft in enumerate(drafts):
        if uniforms[i] < float(probs[i, draft]):
            out.append(draft)
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        out.append(sample_from(residual, noises[i]))
        return out
    out.append(sample_from(probs[len(drafts)], noises[len(drafts)]))
    return out
