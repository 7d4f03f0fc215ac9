"""Logits processing between the grammar mask and temperature, with vLLM's semantics.

Per position, in vLLM's order: the EOS hold of `min_tokens` (end tokens at -inf while fewer
tokens than min_tokens were generated), `logit_bias` (added), the penalties (repetition over
prompt + output: positive logits / p, negative x p; frequency x count and presence over the
output, subtracted, as OpenAI defines them), then `min_p`: tokens whose tempered probability
is below min_p x the top one's are dropped. Temperature, top-k and top-p follow in the sampler.

A draft-verify row's position p counts its drafts before p as generated, so verifying k
drafts picks what k + 1 single steps would. The EOS hold never empties a row: where the
grammar allows nothing but an end token (the constrained output is complete), the end token
stays allowed.

One implementation for every path that picks a token: the CPU sampler (steps, verify, the
token right after prefill) and the device sampler of eager GPU steps apply `apply` to
tensors on the logits' device; the CUDA graphs do not run rows that use any of it
(`CudaGraphRunner.can_graph`). Rows that use none of it cost nothing: `of` returns None
when no row of the batch does, and leaves such rows' logits untouched otherwise.

Sparse: each step touches only the (position, token) entries it changes (end tokens, biased
tokens, the history's distinct tokens), so its cost grows with the history, not with
positions x vocabulary; only the hold's check and min_p read whole rows.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from generation_service.engine.sample_row import SampleRow

_MAX_LOGIT = 1e4  # far above any logit a softmax tells apart from certainty


@dataclass
class Entries:
    """(position, token) entries of the processed logits, with one value each; on the device."""

    positions: torch.Tensor   # (N,) int64, rows of the processed block
    tokens: torch.Tensor      # (N,) int64
    values: torch.Tensor      # (N,) float32


@dataclass
class LogitProcessing:
    """Inputs of `apply` for the P processed positions of a step's (L, V) logits."""

    positions: torch.Tensor | None          # (P,) int64 logit rows processed; None: all L rows
    held: Entries | None                    # end tokens min_tokens holds back (values unused)
    bias: Entries | None                    # logit_bias, added
    repeated: Entries | None                # distinct prompt + output tokens: repetition_penalty
    generated: Entries | None               # distinct output tokens: freq x count + presence
    min_p_threshold: torch.Tensor | None    # (P, 1): temperature x log(min_p), -inf = off

    @classmethod
    def of(cls, rows: list[SampleRow], vocab_size: int,
           device: torch.device | str = "cpu") -> LogitProcessing | None:
        """The processing of (L, V) logits holding the rows' positions back to back; None
        when no row uses any of it."""
        start, spans = 0, []
        for row in rows:
            if row.params.uses_logit_processing:
                spans.append((row, start))
            start += row.num_positions
        if not spans:
            return None
        builder = _Builder(vocab_size)
        for row, first in spans:
            builder.add_row(row, first)
        return builder.build(device, is_all=len(builder.positions) == start)

    def apply(self, logits: torch.Tensor) -> None:
        """In place on float32 (L, V) logits whose NaN and grammar-disallowed tokens are -inf."""
        x = logits if self.positions is None else logits[self.positions]
        if self.held is not None:
            at = (self.held.positions, self.held.tokens)
            kept = x[at]
            x[at] = float("-inf")
            # keep an end token where nothing else is allowed (the grammar is complete)
            others = x.amax(dim=-1) > float("-inf")
            x[at] = torch.where(others[self.held.positions], float("-inf"), kept)
        if self.bias is not None:
            x.index_put_((self.bias.positions, self.bias.tokens), self.bias.values, accumulate=True)
        if self.repeated is not None:
            at, penalty = (self.repeated.positions, self.repeated.tokens), self.repeated.values
            value = x[at]
            # the quotient clamped: a tiny penalty must not make +inf (softmax of +inf is NaN)
            x[at] = torch.where(value > 0, (value / penalty).clamp(max=_MAX_LOGIT), value * penalty)
        if self.generated is not None:
            x.index_put_((self.generated.positions, self.generated.tokens), -self.generated.values,
                         accumulate=True)
        if self.min_p_threshold is not None:
            # p_i < min_p p_max  <=>  (x_i - x_max) / T < log(min_p)
            x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + self.min_p_threshold, float("-inf"))
        if self.positions is not None:
            logits[self.positions] = x


class _Builder:
    """Host lists of entries, made into device tensors once per step."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.positions: list[int] = []
        self.held, self.bias, self.repeated, self.generated = _Lists(), _Lists(), _Lists(), _Lists()
        self.min_p: list[float] = []

    def add_row(self, row: SampleRow, first: int) -> None:
        """The row's positions at logit rows first, first + 1, ...; position p (generated index
        first_index + p) has the drafts before it as generated tokens."""
        params, vocab = row.params, self.vocab_size
        ends = sorted(t for t in row.end_token_ids if t < vocab)
        biases = [(t, b) for t, b in params.logit_bias if t < vocab]
        use_repetition = params.repetition_penalty != 1.0
        use_counts = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        seen = set(row.prompt_ids) | set(row.output_ids) if use_repetition else set()
        counts = Counter(row.output_ids) if use_counts else Counter()
        use_min_p = params.min_p > 0.0 and not params.is_greedy
        for p in range(row.num_positions):
            k = len(self.positions)
            self.positions.append(first + p)
            if p:  # the draft before this position counts as generated
                seen.add(row.drafts[p - 1])
                counts[row.drafts[p - 1]] += 1
            if row.first_index + p < params.min_tokens:
                self.held.extend(k, ends, [0.0] * len(ends))
            self.bias.extend(k, [t for t, _ in biases], [b for _, b in biases])
            if use_repetition:
                tokens = [t for t in seen if t < vocab]
                self.repeated.extend(k, tokens, [params.repetition_penalty] * len(tokens))
            if use_counts:
                tokens = [t for t in counts if t < vocab]
                self.generated.extend(k, tokens, [params.frequency_penalty * counts[t] + params.presence_penalty
                                                  for t in tokens])
            self.min_p.append(params.temperature * math.log(params.min_p) if use_min_p else float("-inf"))

    def build(self, device, is_all: bool) -> LogitProcessing:
        use_min_p = any(v > float("-inf") for v in self.min_p)
        return LogitProcessing(
            positions=None if is_all else torch.tensor(self.positions, dtype=torch.int64).to(device),
            held=self.held.to(device), bias=self.bias.to(device), repeated=self.repeated.to(device),
            generated=self.generated.to(device),
            min_p_threshold=torch.tensor(self.min_p).unsqueeze(1).to(device) if use_min_p else None)


class _Lists:
    """Entries being gathered on the host."""

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.tokens: list[int] = []
        self.values: list[float] = []

    def extend(self, position: int, tokens: list[int], values: list[float]) -> None:
        self.positions.extend([position] * len(tokens))
        self.tokens.extend(tokens)
        self.values.extend(values)

    def to(self, device) -> Entries | None:
        if not self.tokens:
            return None
        ints = torch.tensor([self.positions, self.tokens], dtype=torch.int64).to(device)
        return Entries(ints[0], ints[1], torch.tensor(self.values, dtype=torch.float32).to(device))
