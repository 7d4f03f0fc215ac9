"""The step's grammar masks from the step channel's mapped ring into device memory (Triton).

    out[r, :] = ring[*slot, r, :]    for rows r < bucket (slot: the device ring slot N % D)

Why not `torch.index_select`: the ring lives in host memory, so every load is a PCIe round
trip. index_select spreads 2 MB (128 rows, 131k vocabulary) over hundreds of blocks on
every SM; each block then holds its SM while its loads cross the bus, and on the mask-prefetch
side stream that starves the forward beside it (H200, 1B at batch 64/128: docs/gpu.md,
"Where the masks are read"). Here `programs` CTAs each move (BLOCK_R, BLOCK_W)
tiles with every load of a tile in flight at once (32 KB a tile), so a few programs keep the
bus busy while the forward keeps the rest of the GPU. On the main stream after the forward
(nothing runs beside it) one program per tile puts the whole copy in flight at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R, BLOCK_W = 8, 1024  # a tile: 8 rows x 1024 words = 32 KB in flight per program


@triton.jit
def _mask_gather_kernel(ring_ptr, slot_ptr, out_ptr, bucket, words, stride_slot, stride_row, stride_out,
                        BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    src = ring_ptr + tl.load(slot_ptr).to(tl.int64) * stride_slot
    col_tiles = tl.cdiv(words, BLOCK_W)
    num_tiles = tl.cdiv(bucket, BLOCK_R) * col_tiles
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        rows = (tile // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = (tile % col_tiles) * BLOCK_W + tl.arange(0, BLOCK_W)
        ok = (rows[:, None] < bucket) & (cols[None, :] < words)
        rows = rows.to(tl.int64)
        w = tl.load(src + rows[:, None] * stride_row + cols[None, :], mask=ok)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], w, mask=ok)


def num_tiles(bucket: int, words: int) -> int:
    return triton.cdiv(bucket, BLOCK_R) * triton.cdiv(words, BLOCK_W)


def mask_gather(ring: torch.Tensor, slot: torch.Tensor, out: torch.Tensor, programs: int | None = None) -> None:
    """out (>= bucket, W) int32 rows contiguous <- ring[slot[0], :bucket] with bucket = out's rows
    to fill = ring.shape[1]; ring (D, bucket, W) int32, any entry and row strides (the step
    channel's mapped masks), slot (1,) int64 on the device. programs: CTAs (None: one per tile,
    everything in flight at once). Graph safe: one launch, no host reads."""
    depth, bucket, words = ring.shape
    assert ring.dtype == out.dtype == torch.int32 and ring.stride(2) == 1 and out.stride(1) == 1
    assert out.shape[0] >= bucket and out.shape[1] == words
    assert slot.dtype == torch.int64 and slot.numel() == 1
    if bucket == 0:
        return
    tiles = num_tiles(bucket, words)
    programs = tiles if programs is None else max(1, min(programs, tiles))
    _mask_gather_kernel[(programs,)](
        ring, slot, out, bucket, words, ring.stride(0), ring.stride(1), out.stride(0),
        BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W, NUM_PROGRAMS=programs, num_warps=8)
