"""The decode step's bookkeeping after sampling, in one launch (Triton).

For rows r < bucket, with t = the token sampled for row r:
    out_tokens[r] = t                  what the host reads after the step
    input_ids[r] = t                   fed back: the next (chained) step decodes it
    live = seq_lens[r] > 0             padding rows stay where they are
    positions[r] += live, seq_lens[r] += live
and on a channel step, into the step channel's outputs area at the device ring slot s:
    channel_tokens[s, r] = t (int32), channel_counts[s, r] = 1

Why: in torch these are 5 launches on a free step (a copy, the compare, a copy, two adds)
and 3 more on a channel step (the int32 cast and two index_put), each a graph node of a
few microseconds that the decode forward's PDL chain cannot overlap
(`engine/gpu_runner.py`'s step body; docs/gpu.md "Launch overlap").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128  # rows per program


@triton.jit
def _step_epilogue_kernel(sampled_ptr, out_tokens_ptr, input_ids_ptr, positions_ptr, seq_lens_ptr,
                          ring_slot_ptr, channel_tokens_ptr, channel_counts_ptr,
                          stride_ct_slot, stride_ct_row, stride_cc_slot, bucket,
                          CHANNEL: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < bucket
    token = tl.load(sampled_ptr + rows, mask=mask, other=0).to(tl.int64)
    tl.store(out_tokens_ptr + rows, token, mask=mask)
    tl.store(input_ids_ptr + rows, token, mask=mask)
    seq_len = tl.load(seq_lens_ptr + rows, mask=mask, other=0)
    live = (seq_len > 0).to(seq_len.dtype)
    tl.store(seq_lens_ptr + rows, seq_len + live, mask=mask)
    position = tl.load(positions_ptr + rows, mask=mask, other=0)
    tl.store(positions_ptr + rows, position + live.to(position.dtype), mask=mask)
    if CHANNEL:
        slot = tl.load(ring_slot_ptr).to(tl.int64)
        tl.store(channel_tokens_ptr + slot * stride_ct_slot + rows * stride_ct_row,
                 token.to(tl.int32), mask=mask)
        tl.store(channel_counts_ptr + slot * stride_cc_slot + rows,
                 tl.full([BLOCK], 1, tl.int32), mask=mask)


def step_epilogue(sampled: torch.Tensor, out_tokens: torch.Tensor, input_ids: torch.Tensor,
                  positions: torch.Tensor, seq_lens: torch.Tensor,
                  channel: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """sampled (bucket,) any integer dtype; out_tokens, input_ids (>= bucket,) int64, positions
    and seq_lens (>= bucket,) integer, updated in place. channel: (ring_slot (1,) int64,
    tokens (depth, >= bucket) int32, counts (depth, >= bucket) int32 with contiguous rows), the
    step channel's outputs views (any row stride for tokens). Graph safe: one launch."""
    bucket = sampled.shape[0]
    for t in (sampled, out_tokens, input_ids, positions, seq_lens):
        assert t.stride(0) == 1 and t.shape[0] >= bucket
    if channel is not None:
        ring_slot, tokens, counts = channel
        assert counts.stride(1) == 1 and tokens.dtype == counts.dtype == torch.int32
    else:
        ring_slot = tokens = counts = sampled  # never read without CHANNEL
    if bucket:
        _step_epilogue_kernel[(triton.cdiv(bucket, BLOCK),)](
            sampled, out_tokens, input_ids, positions, seq_lens, ring_slot, tokens, counts,
            tokens.stride(0), tokens.stride(-1), counts.stride(0), bucket,
            CHANNEL=channel is not None, BLOCK=BLOCK, num_warps=4)


def step_epilogue_torch(sampled: torch.Tensor, out_tokens: torch.Tensor, input_ids: torch.Tensor,
                        positions: torch.Tensor, seq_lens: torch.Tensor,
                        channel: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """The same in torch ops (the launches the kernel replaces): a reference and an A/B baseline."""
    bucket = sampled.shape[0]
    tokens = sampled.long()
    out_tokens[:bucket].copy_(tokens)
    if channel is not None:
        ring_slot, channel_tokens, channel_counts = channel
        channel_tokens[:, :bucket].index_put_((ring_slot,), sampled.int().view(1, bucket))
        channel_counts[:, :bucket].index_put_((ring_slot,), torch.ones_like(channel_counts[:1, :bucket]))
    live = seq_lens[:bucket] > 0
    input_ids[:bucket].copy_(tokens)
    positions[:bucket].add_(live)
    seq_lens[:bucket].add_(live)  # bool promotes to the int32 of seq_lens: no cast kernel
