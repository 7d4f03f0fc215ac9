"""What the fused decode forward needs before its first layer, in one launch (Triton).

For each token slot t:
    hidden[t]  = embed[clamp(ids[t], 0, vocab - 1)]        (the embedding gather)
    cos[t], sin[t] = cos_table[positions[t]], sin_table[positions[t]]
    slot_ids[t] = page_table[t, positions[t] // page_size] * page_size + positions[t] % page_size
                  (decode only: one token per row; the verify graphs bring their own slots)

Why: in torch these are ~15 launches (clamp, gather; the angle product, cat, cos, sin and
casts of `RotaryEmbedding`; six integer ops for the slots), each a drained grid in the
graph that PDL (pdl.py) cannot overlap. The cos/sin tables are `RotaryEmbedding`'s own
output over every position the cache can hold, made once by torch, so the values are the
ones the unfused step computes; positions and page columns are clamped into their tables.

`publish` (a channel step of a captured decode graph): the first program also stores the device
step counter N into the step channel's inputs_seq word (a fence, then a system-scope store;
sysmem.py), replacing a write memop and a copy kernel in front of the forward. Nothing the GPU
writes in step N precedes it: the previous step's outputs were fenced before its outputs_seq.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from .sysmem import SYS_FENCE, fence_system, store_seq

BLOCK_H = 1024  # hidden columns per program: the gather spreads over hidden / 1024 programs a token


@triton.jit
def _prologue_kernel(ids_ptr, positions_ptr, page_table_ptr, embed_ptr, cos_table_ptr, sin_table_ptr,
                     hidden_ptr, cos_ptr, sin_ptr, slot_ptr, step_ptr, seq_ptr,
                     vocab_size, hidden_size, num_positions, stride_e, stride_pt, max_pages,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                     PAGE_SIZE: tl.constexpr, HAS_PAGES: tl.constexpr, PUBLISH: tl.constexpr,
                     SYS_FENCE: tl.constexpr, PDL: tl.constexpr):
    """Grid (T, cdiv(hidden, BLOCK_H)): every program gathers BLOCK_H embedding columns of its
    token; the first of each token also copies its cos/sin rows and writes its cache slot."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # before any global access (pdl.py)
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    token = tl.minimum(tl.maximum(tl.load(ids_ptr + t), 0), vocab_size - 1).to(tl.int64)
    offs = block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden_size
    row = tl.load(embed_ptr + token * stride_e + offs, mask=mask)
    tl.store(hidden_ptr + t * hidden_size + offs, row, mask=mask)
    if block == 0:
        position = tl.load(positions_ptr + t).to(tl.int64)
        at = tl.minimum(tl.maximum(position, 0), num_positions - 1) * HEAD_DIM
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        tl.store(cos_ptr + t * HEAD_DIM + offs_d, tl.load(cos_table_ptr + at + offs_d, mask=d_mask),
                 mask=d_mask)
        tl.store(sin_ptr + t * HEAD_DIM + offs_d, tl.load(sin_table_ptr + at + offs_d, mask=d_mask),
                 mask=d_mask)
        if HAS_PAGES:
            col = tl.minimum(position // PAGE_SIZE, max_pages - 1)
            page = tl.load(page_table_ptr + t * stride_pt + col).to(tl.int64)
            tl.store(slot_ptr + t, page * PAGE_SIZE + position % PAGE_SIZE)
    if PUBLISH:
        if (t == 0) & (block == 0):
            n = tl.load(step_ptr)
            one = tl.arange(0, 1)
            if SYS_FENCE:
                fence_system(one)
            store_seq(seq_ptr, n, one, SYS_FENCE)


def decode_prologue(ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor,
                    cos_table: torch.Tensor, sin_table: torch.Tensor,
                    page_table: torch.Tensor | None = None, page_size: int = 0,
                    publish: tuple[torch.Tensor, torch.Tensor] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(hidden (T, H) in embed's dtype, cos (T, D), sin (T, D), slot_ids (T,) int64 or None).
    ids, positions (T,) integer; embed (vocab, H) rows contiguous; cos/sin tables (P, D)
    contiguous (row p: position p); page_table (T, max_pages), one row per token (decode), or
    None: no slots. publish: (step (1,) int32 the device step counter N, inputs_seq (1,) int32
    the mapped sequence word): inputs_seq = N (module docstring). Graph safe: one launch, no
    host reads."""
    num_tokens, (vocab_size, hidden_size) = ids.shape[0], embed.shape
    num_positions, head_dim = cos_table.shape
    assert embed.stride(1) == 1 and cos_table.is_contiguous() and sin_table.is_contiguous()
    assert sin_table.shape == cos_table.shape and positions.shape == ids.shape
    device = embed.device
    hidden = torch.empty(num_tokens, hidden_size, dtype=embed.dtype, device=device)
    cos = torch.empty(num_tokens, head_dim, dtype=cos_table.dtype, device=device)
    sin = torch.empty_like(cos)
    slot_ids = None
    if page_table is not None:
        assert page_table.shape[0] == num_tokens and page_table.stride(1) == 1 and page_size > 0
        slot_ids = torch.empty(num_tokens, dtype=torch.int64, device=device)
    if publish is not None:
        step, seq = publish
        assert step.dtype == seq.dtype == torch.int32 and num_tokens > 0
    else:
        step = seq = ids  # never read without PUBLISH
    if num_tokens:
        table = page_table if page_table is not None else ids  # never read without HAS_PAGES
        _prologue_kernel[(num_tokens, triton.cdiv(hidden_size, BLOCK_H))](
            ids, positions, table, embed, cos_table, sin_table, hidden, cos, sin,
            slot_ids if slot_ids is not None else ids, step, seq,
            vocab_size, hidden_size, num_positions, embed.stride(0),
            table.stride(0), table.shape[1] if page_table is not None else 1,
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_H=BLOCK_H,
            PAGE_SIZE=max(page_size, 1), HAS_PAGES=page_table is not None,
            PUBLISH=publish is not None, SYS_FENCE=SYS_FENCE, num_warps=4,
            **pdl_launch(embed))
    return hidden, cos, sin, slot_ids
