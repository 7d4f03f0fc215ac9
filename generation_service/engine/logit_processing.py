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
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from generation_service.engine.sampler import SampleRow


_MAX_LOGIT = 1e4  # far above any logit a softmax tells apart from certainty


@dataclass
class LogitProcessing:
    """Inputs of `apply` for the P processed positions of a step's (L, V) logits."""

    positions: torch.Tensor | None          # (P,) int64 logit rows processed; None: all L rows
    held: torch.Tensor | None               # (P, V) bool: end tokens min_tokens holds back
    bias: torch.Tensor | None               # (P, V) float32 added to the logits
    seen: torch.Tensor | None               # (P, V) bool: in the prompt or the output so far
    repetition_penalty: torch.Tensor        # (P, 1) float32, 1 = off
    output_counts: torch.Tensor | None      # (P, V) float32: times generated so far
    frequency_penalty: torch.Tensor         # (P, 1) float32, 0 = off
    presence_penalty: torch.Tensor          # (P, 1) float32, 0 = off
    min_p_threshold: torch.Tensor | None    # (P, 1): temperature x log(min_p), -inf = off

    @classmethod
    def of(cls, rows: list[SampleRow], vocab_size: int, device: torch.device | str = "cpu",
           num_logit_rows: int | None = None) -> LogitProcessing | None:
        """The processing of a step whose logits hold rows' positions back to back; None when
        no row uses any of it. `num_logit_rows` (default: the rows' positions) lets a caller
        whose logits have exactly these rows skip the gather."""
        start, spans = 0, []
        for row in rows:
            if row.params.uses_logit_processing:
                spans.append((row, start))
            start += row.num_positions
        if not spans:
            return None
        builder = _Builder(vocab_size)
        for row, first in spans:
            for p in range(row.num_positions):
                builder.add(row, first + p, p)
        is_all = len(builder.positions) == (num_logit_rows if num_logit_rows is not None else start)
        return builder.build(device, is_all)

    def apply(self, logits: torch.Tensor) -> None:
        """In place on float32 (L, V) logits whose NaN and grammar-disallowed tokens are -inf."""
        x = logits if self.positions is None else logits[self.positions]
        if self.held is not None:
            # keep an end token where nothing else is allowed (the grammar is complete)
            others = x.masked_fill(self.held, float("-inf")).amax(dim=-1, keepdim=True) > float("-inf")
            x.masked_fill_(self.held & others, float("-inf"))
        if self.bias is not None:
            x += self.bias
        if self.seen is not None:
            # the quotient clamped: a tiny penalty must not make +inf (softmax of +inf is NaN)
            quotient = (x / self.repetition_penalty).clamp(max=_MAX_LOGIT)
            penalized = torch.where(x > 0, quotient, x * self.repetition_penalty)
            x = torch.where(self.seen, penalized, x)
        if self.output_counts is not None:
            x -= self.frequency_penalty * self.output_counts + self.presence_penalty * (self.output_counts > 0)
        if self.min_p_threshold is not None:
            # p_i < min_p p_max  <=>  (x_i - x_max) / T < log(min_p)
            x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + self.min_p_threshold, float("-inf"))
        if self.positions is None:
            if x.data_ptr() != logits.data_ptr():
                logits.copy_(x)
        else:
            logits[self.positions] = x


class _Builder:
    """Host lists of (position, token) entries, made into dense tensors once per step."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.positions: list[int] = []
        self.held: tuple[list[int], list[int]] = ([], [])
        self.bias: tuple[list[int], list[int], list[float]] = ([], [], [])
        self.seen: tuple[list[int], list[int]] = ([], [])
        self.counted: tuple[list[int], list[int]] = ([], [])
        self.repetition, self.frequency, self.presence, self.min_p = [], [], [], []

    def add(self, row: SampleRow, position: int, offset: int) -> None:
        """Position `offset` of `row` (generated index first_index + offset) at logit row `position`."""
        params, k = row.params, len(self.positions)
        self.positions.append(position)
        if row.first_index + offset < params.min_tokens:
            ends = [t for t in row.end_token_ids if t < self.vocab_size]
            self.held[0].extend([k] * len(ends))
            self.held[1].extend(ends)
        for token, value in params.logit_bias:
            if token < self.vocab_size:
                self._append(self.bias, k, token, value)
        output = list(row.output_ids) + row.drafts[:offset]
        if params.repetition_penalty != 1.0:
            tokens = list(row.prompt_ids) + output
            self.seen[0].extend([k] * len(tokens))
            self.seen[1].extend(tokens)
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            self.counted[0].extend([k] * len(output))
            self.counted[1].extend(output)
        self.repetition.append(params.repetition_penalty)
        self.frequency.append(params.frequency_penalty)
        self.presence.append(params.presence_penalty)
        use_min_p = params.min_p > 0.0 and not params.is_greedy
        self.min_p.append(params.temperature * math.log(params.min_p) if use_min_p else float("-inf"))

    @staticmethod
    def _append(lists, *values) -> None:
        for target, value in zip(lists, values):
            target.append(value)

    def build(self, device, is_all: bool) -> LogitProcessing:
        shape = (len(self.positions), self.vocab_size)

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).unsqueeze(1).to(device)

        def dense(entries, dtype, accumulate: bool = False) -> torch.Tensor | None:
            if not entries[0]:
                return None
            out = torch.zeros(shape, dtype=dtype, device=device)
            index = torch.tensor(entries[:2], dtype=torch.int64).to(device)
            values = (torch.tensor(entries[2], dtype=dtype) if len(entries) > 2
                      else torch.ones(index.shape[1], dtype=dtype)).to(device)
            out.index_put_((index[0], index[1]), values, accumulate=accumulate)
            return out

        return LogitProcessing(
            positions=None if is_all else torch.tensor(self.positions, dtype=torch.int64).to(device),
            held=dense(self.held, torch.bool), bias=dense(self.bias, torch.float32),
            seen=dense(self.seen, torch.bool), repetition_penalty=column(self.repetition),
            output_counts=dense(self.counted, torch.float32, accumulate=True), frequency_penalty=column(self.frequency),
            presence_penalty=column(self.presence),
            min_p_threshold=column(self.min_p) if any(v > float("-inf") for v in self.min_p) else None)
