"""The mixed step on the GPU: prefill chunks of several requests and decode rows in one forward.

Every batch the captured graphs cannot run (a prefill chunk anywhere in it, logprobs, drafts too
wide for the verify graphs) comes here. The rows' new tokens are packed into one flat layout on
the host (`pack_mixed`: numpy, no per-token Python), uploaded in two copies, and the fused layer
loop of `DecodeForward` runs over all T tokens at once: cuBLAS GEMMs of T rows, the Triton RoPE +
K/V write of every token into its page slot, and per layer two attention launches over the paged
cache (`MixedAttention`):

    tokens [0, D)   decode rows, one new token each   -> the split-K decode kernel
    tokens [D, T)   prefill chunks and verify rows    -> the varlen extend kernel (causal, GQA)

so a decode row costs in a mixed step what it costs in a decode graph (the extend kernel's
prefill tiles would spend 128 query rows of tensor-core work on its 4). Nothing in the forward
reads the host; the logits are those of the sampling positions only (L rows, in batch order:
the contract of `ModelRunner.run`), so a 2,048-token chunk pays for one LM-head row, not 2,048.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Callable

import numpy as np
import torch

from generation_service.engine.decode_forward import CUBLAS, DecodeForward, DecodeMeta
from generation_service.engine.fed_back import FedBack
from generation_service.engine.kv_cache import offsets_within, page_table_of
from generation_service.engine.pinned import PinnedStaging
from generation_service.engine.scheduler import ScheduledRow


@dataclass
class MixedLayout:
    """One mixed step on the host. Rows are reordered: decode rows (one new token) first."""

    input_ids: np.ndarray       # (T,) int64, clamped into the vocabulary
    positions: np.ndarray       # (T,) int64 absolute position of each token
    slot_ids: np.ndarray        # (T,) int64 flat cache slot (page * page_size + offset)
    logits_indices: np.ndarray  # (L,) int64 token of each sampling position, in batch order
    page_table: np.ndarray      # (B, W) int32, packed row order; unused entries 0 (dummy page)
    seq_lens: np.ndarray        # (B,) int32 cached + new tokens after the step
    extend_lens: np.ndarray     # (B,) int32 new tokens of each row
    extend_start: np.ndarray    # (B - D,) int64 first token of each extend row, from token D
    num_decode_rows: int        # D
    max_extend_len: int         # longest extend row (0: there is none)
    row_starts: np.ndarray      # (B,) int64 first token of each row, in batch order

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def pack_mixed(rows: list[ScheduledRow], page_size: int, vocab_size: int) -> MixedLayout:
    """The packed layout of `rows` (each with >= 1 new token: its uncached tokens, then drafts)."""
    # the rows' order and page table in numpy, not per row in Python: a step has over a hundred rows
    num_rows = len(rows)
    batch_lens = np.fromiter((len(row.input_ids) for row in rows), dtype=np.int64, count=num_rows)
    order = np.argsort(batch_lens > 1, kind="stable")  # decode rows (one new token) first
    packed = [rows[i] for i in order.tolist()]
    lens = batch_lens[order]
    num_decode = int(np.count_nonzero(batch_lens == 1))
    starts = np.cumsum(lens) - lens
    num_tokens = int(lens.sum())
    input_ids = np.fromiter(chain.from_iterable(row.input_ids for row in packed), dtype=np.int64,
                            count=num_tokens)
    np.clip(input_ids, 0, vocab_size - 1, out=input_ids)  # a bad id never indexes past the table
    cached = np.fromiter((row.num_cached for row in packed), dtype=np.int64, count=num_rows)
    token_rows = np.repeat(np.arange(num_rows), lens)
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(cached - starts, lens)
    page_table = page_table_of([row.request.pages for row in packed])
    columns = np.minimum(positions // page_size, page_table.shape[1] - 1)
    slot_ids = page_table[token_rows, columns].astype(np.int64) * page_size + positions % page_size
    where = np.empty(num_rows, dtype=np.int64)  # batch index -> packed row
    where[order] = np.arange(num_rows)
    # each row's sampling positions are its last num_positions tokens, in batch order
    num_positions = np.fromiter((row.num_positions for row in rows), dtype=np.int64, count=num_rows)
    ends = (starts + lens)[where]
    logits_indices = np.repeat(ends - num_positions, num_positions) + offsets_within(num_positions)
    extend_lens = lens.astype(np.int32)
    return MixedLayout(
        input_ids=input_ids, positions=positions, slot_ids=slot_ids,
        logits_indices=logits_indices, page_table=page_table,
        seq_lens=(cached + lens).astype(np.int32), extend_lens=extend_lens,
        extend_start=starts[num_decode:] - num_decode, num_decode_rows=num_decode,
        max_extend_len=int(lens[num_decode:].max()) if num_rows > num_decode else 0,
        row_starts=starts[where])


@dataclass
class MixedInputs:
    """A MixedLayout on the device."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_ids: torch.Tensor
    logits_indices: torch.Tensor
    extend_start: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor


class MixedAttention:
    """Attention of one mixed step over the paged cache: decode rows [0, D) through the
    decode kernel, extend rows [D, T) through the varlen extend kernel, into one output."""

    def __init__(self, forward: DecodeForward, inputs: MixedInputs, layout: MixedLayout) -> None:
        d = layout.num_decode_rows
        self.attention, self.kv, config = forward.attention, forward.kv, forward.config
        self.scale, self.window = config.head_dim ** -0.5, config.sliding_window
        self.num_decode, self.num_rows = d, layout.seq_lens.shape[0]
        self.max_extend_len, self.extend_start = layout.max_extend_len, inputs.extend_start
        self.decode_meta = DecodeMeta(inputs.page_table[:d], inputs.seq_lens[:d], inputs.extend_lens[:d])
        self.extend_meta = DecodeMeta(inputs.page_table[d:], inputs.seq_lens[d:], inputs.extend_lens[d:])

    def __call__(self, q: torch.Tensor, index: int) -> torch.Tensor:
        """q (T, Hq, D) of every new token, rotated, its K/V in the cache -> (T, Hq, D)."""
        q = q.contiguous()
        out = torch.empty_like(q)
        k, v, d, scales = self.kv.k[index], self.kv.v[index], self.num_decode, self.kv.scales(index)
        if d:
            self.attention.decode(q[:d], k, v, self.decode_meta, self.scale, sliding_window=self.window,
                                  out=out[:d], **scales)
        if self.num_rows > d:
            self.attention.extend(q[d:], k, v, self.extend_meta, self.scale, max_extend_len=self.max_extend_len,
                                  sliding_window=self.window, out=out[d:], extend_start=self.extend_start,
                                  **scales)
        return out


class MixedForward:
    """Callable: the rows of a step -> (L, vocab) logits of their sampling positions (batch
    order), through `forward`'s weights and layer loop (fused path: bf16 logits, as the
    decode graphs sample them)."""

    def __init__(self, forward: DecodeForward) -> None:
        self.forward = forward
        self.page_size = forward.kv.page_size
        self.vocab_size = forward.config.vocab_size
        self.staging = PinnedStaging(forward.kv.device)
        self.num_steps = 0
        self.num_tokens = 0

    def upload(self, layout: MixedLayout) -> MixedInputs:
        ids, positions, slots, logits_indices, extend_start = self.staging.upload(torch.int64, [
            layout.input_ids, layout.positions, layout.slot_ids, layout.logits_indices, layout.extend_start])
        table, seq_lens, extend_lens = self.staging.upload(torch.int32, [
            layout.page_table, layout.seq_lens, layout.extend_lens])
        return MixedInputs(ids, positions, slots, logits_indices, extend_start,
                           table.view(layout.page_table.shape), seq_lens, extend_lens)

    @torch.inference_mode()
    def __call__(self, rows: list[ScheduledRow], fed_back: FedBack | None = None,
                 layer_ids: tuple[int, ...] | None = None) -> torch.Tensor:
        """layer_ids: only these decoder layers (a self-speculative draft, self_drafts.py)."""
        layout = pack_mixed(rows, self.page_size, self.vocab_size)
        inputs = self.upload(layout)
        if fed_back is not None:
            fed_back.apply(inputs.input_ids, layout.row_starts, self.staging)
        attend: Callable = MixedAttention(self.forward, inputs, layout)
        self.num_steps += 1
        self.num_tokens += layout.num_tokens
        return self.forward.tokens(inputs.input_ids, inputs.positions, inputs.slot_ids, attend, CUBLAS,
                                   logits_indices=inputs.logits_indices, layer_ids=layer_ids)
