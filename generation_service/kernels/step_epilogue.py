"""The decode step's bookkeeping after sampling, in one launch (Triton).

For rows r < bucket, with t = the token sampled for row r:
    out_tokens[r] = t                  what the host reads after the step
    input_ids[r] = t                   fed back: the next (chained) step decodes it
    live = seq_lens[r] > 0             padding rows stay where they are
    positions[r] += live, seq_lens[r] += live
and on a channel step, into the step channel's outputs area at the device ring slot s:
    channel_tokens[s, r] = t (int32), channel_counts[s, r] = 1
and when the step also publishes (`publish`, one program only), with N the device step counter:
    outputs_seq = N, then step = N + 1, ring_slot = (N + 1) mod depth

Publish ordering (NOTE: grammar_service, on the CPU, reads outputs_seq and then the outputs
area): every thread fences its stores system-wide (`fence.sc.sys`, __threadfence_system),
the CTA barrier makes every thread's fence precede it, and only then does one thread store
outputs_seq (`st.relaxed.sys`, a volatile store; not an atomic: the H200 hosts have no
native atomics on mapped host memory, CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED = 0).
The barrier also keeps the step counter's and the ring slot's new values from landing
before every thread has read the old ones. Under the interpreter (no inline asm, one
program run in order) the fence is left out.

Why: in torch these are 5 launches on a free step (a copy, the compare, a copy, two adds)
and 3 more on a channel step (the int32 cast and two index_put), each a graph node of a
few microseconds that the decode forward's PDL chain cannot overlap
(`engine/gpu_runner.py`'s step body; docs/gpu.md, "The step tail in the epilogue"); publishing folds in
`gpu_runner.publish_step_seq` + `advance_channel_step` (a write memop and 3 kernels).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sysmem import SYS_FENCE, fence_system, store_seq

BLOCK = 128  # rows per program
MAX_PUBLISH_ROWS = BLOCK  # a publishing epilogue runs one program


@triton.jit
def _step_epilogue_kernel(sampled_ptr, out_tokens_ptr, input_ids_ptr, positions_ptr, seq_lens_ptr,
                          ring_slot_ptr, channel_tokens_ptr, channel_counts_ptr,
                          step_ptr, seq_ptr, stride_ct_slot, stride_ct_row, stride_cc_slot, bucket, depth,
                          CHANNEL: tl.constexpr, PUBLISH: tl.constexpr, SYS_FENCE: tl.constexpr,
                          BLOCK: tl.constexpr):
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
    if PUBLISH:  # one program (the wrapper checks): the barrier orders every row's stores
        n = tl.load(step_ptr)
        if SYS_FENCE:
            fence_system(rows)  # each thread: its outputs visible system-wide ...
        tl.debug_barrier()  # ... before any thread passes (every thread has read step and ring_slot)
        store_seq(seq_ptr, n, rows, SYS_FENCE)
        n_next = n + 1
        tl.store(step_ptr, n_next)
        tl.store(ring_slot_ptr, ((n_next % depth + depth) % depth).to(tl.int64))  # as torch.remainder


def step_epilogue(sampled: torch.Tensor, out_tokens: torch.Tensor, input_ids: torch.Tensor,
                  positions: torch.Tensor, seq_lens: torch.Tensor,
                  channel: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  publish: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """sampled (bucket,) any integer dtype; out_tokens, input_ids (>= bucket,) int64, positions
    and seq_lens (>= bucket,) integer, updated in place. channel: (ring_slot (1,) int64,
    tokens (depth, >= bucket) int32, counts (depth, >= bucket) int32 with contiguous rows), the
    step channel's outputs views (any row stride for tokens). publish (needs channel and
    bucket <= BLOCK): (step (1,) int32 the device step counter N, outputs_seq (1,) int32 the
    mapped sequence word): outputs_seq = N after the outputs, then N + 1 and its ring slot
    (mod the depth of `tokens`). Graph safe: one launch."""
    bucket = sampled.shape[0]
    for t in (sampled, out_tokens, input_ids, positions, seq_lens):
        assert t.stride(0) == 1 and t.shape[0] >= bucket
    if channel is not None:
        ring_slot, tokens, counts = channel
        assert counts.stride(1) == 1 and tokens.dtype == counts.dtype == torch.int32
    else:
        assert publish is None, "publishing needs the channel's outputs"
        ring_slot = tokens = counts = sampled  # never read without CHANNEL
    if publish is not None:
        step, seq = publish
        assert step.dtype == seq.dtype == torch.int32 and ring_slot.dtype == torch.int64
        if not 0 < bucket <= MAX_PUBLISH_ROWS:  # NOTE: a barrier orders stores within one program only
            raise ValueError(f"a publishing epilogue runs one program: bucket {bucket} not in [1, {BLOCK}]")
    else:
        step = seq = sampled  # never read without PUBLISH
    if bucket:
        _step_epilogue_kernel[(triton.cdiv(bucket, BLOCK),)](
            sampled, out_tokens, input_ids, positions, seq_lens, ring_slot, tokens, counts, step, seq,
            tokens.stride(0), tokens.stride(-1), counts.stride(0), bucket, tokens.shape[0],
            CHANNEL=channel is not None, PUBLISH=publish is not None,
            SYS_FENCE=SYS_FENCE, BLOCK=BLOCK, num_warps=4)


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
