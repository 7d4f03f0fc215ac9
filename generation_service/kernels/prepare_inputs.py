"""Fused decode / verify input preparation: one launch, one program, graph safe.

Persistent buffers hold ``max_rows`` rows and ``max_tokens`` token slots. Rows below
``num_rows`` (a device scalar, so a captured graph serves any real batch size up to its
bucket) are real; row b contributes ``num_new[b]`` tokens (1 for decode, 1 + drafts for
verify), packed row-major: row b's tokens start at the exclusive cumsum of num_new.

For real token t of row b (0 <= t < num_new[b]):
    position = seq_lens_before[b] + t
    slot_id  = page_table[b, position // page_size] * page_size + position % page_size
    input_id = clamp(input_id, 0, vocab_size - 1)            (in place)
Padding (token slots past the real total, all tokens of rows >= num_rows):
    position = 0, slot_id = 0 (dummy page), input_id = 0      (the scrub)
Per row: seq_lens = before + n, extend_lens = n, last_token_indices = start + n - 1,
with n = 0 (and all three 0) for padding rows, so attention writes zeros for them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class PreparedInputs:
    """The buffers prepare_decode_inputs writes; allocate once, reuse every step."""

    positions: torch.Tensor  # (max_tokens,) int64
    slot_ids: torch.Tensor  # (max_tokens,) int64, index into the flattened cache
    seq_lens: torch.Tensor  # (max_rows,) int32, after this forward
    extend_lens: torch.Tensor  # (max_rows,) int32
    last_token_indices: torch.Tensor  # (max_rows,) int64, logits row of each row's last token

    @classmethod
    def allocate(cls, max_rows: int, max_tokens: int, device) -> "PreparedInputs":
        def full(n, dtype):
            return torch.full((n,), -7, dtype=dtype, device=device)
        return cls(full(max_tokens, torch.int64), full(max_tokens, torch.int64),
                   full(max_rows, torch.int32), full(max_rows, torch.int32),
                   full(max_rows, torch.int64))


@triton.jit
def _prepare_kernel(
    input_ids_ptr, seq_lens_before_ptr, num_new_ptr, page_table_ptr, num_rows_ptr,
    positions_ptr, slot_ids_ptr, seq_lens_ptr, extend_lens_ptr, last_ptr,
    max_rows, max_tokens, stride_ptb, max_pages, vocab_size,
    PAGE_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    num_rows = tl.load(num_rows_ptr)
    rows = tl.arange(0, BLOCK_R)
    row_in = rows < max_rows
    is_real = rows < num_rows
    n = tl.load(num_new_ptr + rows, mask=row_in & is_real, other=0)
    before = tl.load(seq_lens_before_ptr + rows, mask=row_in & is_real, other=0)
    start = tl.cumsum(n, 0) - n  # exclusive cumsum: first token slot of each row
    total = tl.sum(n, 0)
    tl.store(seq_lens_ptr + rows, tl.where(is_real, before + n, 0), mask=row_in)
    tl.store(extend_lens_ptr + rows, n, mask=row_in)
    tl.store(last_ptr + rows, tl.where(n > 0, start + n - 1, 0).to(tl.int64), mask=row_in)

    # (row, t) tile of real tokens, scattered to their packed slots.
    t = tl.arange(0, BLOCK_W)
    real = (t[None, :] < n[:, None]) & row_in[:, None]
    dest = start[:, None] + t[None, :]
    real = real & (dest < max_tokens)
    pos = before[:, None].to(tl.int64) + t[None, :]
    col = tl.minimum(pos // PAGE_SIZE, max_pages - 1)
    page = tl.load(page_table_ptr + rows[:, None].to(tl.int64) * stride_ptb + col,
                   mask=real, other=0).to(tl.int64)
    tl.store(positions_ptr + dest, pos, mask=real)
    tl.store(slot_ids_ptr + dest, page * PAGE_SIZE + pos % PAGE_SIZE, mask=real)
    ids = tl.load(input_ids_ptr + dest, mask=real, other=0)
    ids = tl.minimum(tl.maximum(ids, 0), vocab_size - 1)
    tl.store(input_ids_ptr + dest, ids, mask=real)

    # Scrub the padding tail so stale ids/slots from a larger earlier batch never leak.
    for t0 in range(0, max_tokens, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        tail = (offs >= total) & (offs < max_tokens)
        zero = tl.zeros([BLOCK_T], tl.int64)
        tl.store(positions_ptr + offs, zero, mask=tail)
        tl.store(slot_ids_ptr + offs, zero, mask=tail)
        tl.store(input_ids_ptr + offs, zero.to(input_ids_ptr.dtype.element_ty), mask=tail)


def prepare_decode_inputs(input_ids: torch.Tensor, seq_lens_before: torch.Tensor,
                          num_new: torch.Tensor, page_table: torch.Tensor,
                          num_rows: torch.Tensor, out: PreparedInputs, page_size: int,
                          vocab_size: int, max_new_per_row: int = 1) -> PreparedInputs:
    """Fill ``out`` and clamp/scrub ``input_ids`` in place (see the module docstring).

    num_rows is a (1,) int32 device tensor; num_new[b] must be <= max_new_per_row.
    """
    max_rows = seq_lens_before.shape[0]
    max_tokens = input_ids.shape[0]
    _prepare_kernel[(1,)](
        input_ids, seq_lens_before, num_new, page_table, num_rows,
        out.positions, out.slot_ids, out.seq_lens, out.extend_lens, out.last_token_indices,
        max_rows, max_tokens, page_table.stride(0), page_table.shape[1], vocab_size,
        PAGE_SIZE=page_size, BLOCK_R=triton.next_power_of_2(max(max_rows, 2)),
        BLOCK_W=triton.next_power_of_2(max(max_new_per_row, 2)), BLOCK_T=1024,
        num_warps=4,
    )
    return out


def prepare_decode_inputs_torch(input_ids: torch.Tensor, seq_lens_before: torch.Tensor,
                                num_new: torch.Tensor, page_table: torch.Tensor,
                                num_rows: torch.Tensor, out: PreparedInputs, page_size: int,
                                vocab_size: int, max_new_per_row: int = 1) -> PreparedInputs:
    """Reference with the same contract, written as plain host-side loops."""
    num_real = int(num_rows.item())
    n_all = [int(x) if b < num_real else 0 for b, x in enumerate(num_new.tolist())]
    ids = input_ids.tolist()
    positions = [0] * len(ids)
    slots = [0] * len(ids)
    cursor = 0
    for b, n in enumerate(n_all):
        before = int(seq_lens_before[b]) if b < num_real else 0
        out.seq_lens[b] = before + n if b < num_real else 0
        out.extend_lens[b] = n
        out.last_token_indices[b] = cursor + n - 1 if n else 0
        for t in range(n):
            pos = before + t
            page = int(page_table[b, min(pos // page_size, page_table.shape[1] - 1)])
            positions[cursor] = pos
            slots[cursor] = page * page_size + pos % page_size
            ids[cursor] = min(max(ids[cursor], 0), vocab_size - 1)
            cursor += 1
    ids[cursor:] = [0] * (len(ids) - cursor)
    input_ids.copy_(torch.tensor(ids, dtype=input_ids.dtype))
    out.positions.copy_(torch.tensor(positions, dtype=torch.int64))
    out.slot_ids.copy_(torch.tensor(slots, dtype=torch.int64))
    return out
