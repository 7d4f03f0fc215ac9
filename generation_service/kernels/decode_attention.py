"""Paged decode attention: one query token per row, GQA-aware, split over the KV length.

Flash-decoding in two launches:
1. ``_decode_split_kernel``, grid (B, num_kv_heads, num_splits): one program loads the
   GROUP query heads that share a kv head (so K/V are read once per group, not once per
   query head), walks its slice of the row's KV through the page table with an online
   softmax, and writes a partial output and its log-sum-exp.
2. ``_decode_reduce_kernel``, grid (B, num_q_heads): merges the splits by their LSE
   (skipped when there is one split: large batches fill the GPU without splitting, and
   the split kernel then writes the output itself).

The split count is fixed at launch (it never depends on ``seq_lens`` values), so the
launch is CUDA-graph safe; a split whose slice is empty writes LSE = -inf and is ignored.
A row with ``seq_len == 0`` (a padding row) gets an all-zero output.

Cache layout: k/v each (num_pages, page_size, num_kv_heads, head_dim), last dim
contiguous; page_table (B, max_pages) int32, unused entries 0 (the dummy page). FP8 pages
(engine/kv_cache.py) are widened to q's dtype as they are loaded: k's scale folds into
sm_scale, v's into the output (both are linear in it).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from generation_service.engine.kv_cache import from_cache, gather_pages

from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait

_NUM_SMS_FALLBACK = 132  # H200; used when no CUDA device is visible (interpreter)


# NOTE: the page table's width changes from one eager (mixed) step to the next; specialising on
# it (== 1, % 16) would recompile mid-serving.
@triton.jit(do_not_specialize=["stride_ptb", "max_pages"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr, out_ptr,
    sm_scale, v_scale, window,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ptb, max_pages,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_outb, stride_outh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before any global access (pdl.py)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # Sliding window (window > 0): the query at seq_len - 1 sees the last `window` keys.
    kv_start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # Split length rounded up to BLOCK_N so every split but the last is full blocks.
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = kv_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head = kvh * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # (H, D)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    pt_row = page_table_ptr + b.to(tl.int64) * stride_ptb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        # NOTE: clamp the page-table column so a bad seq_len cannot read past the row.
        col = tl.minimum(offs_n // PAGE_SIZE, max_pages - 1)
        page = tl.load(pt_row + col, mask=n_mask, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_ks
                    + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)  # (N, D)
        qk = tl.dot(q, tl.trans(k.to(q.dtype))) * sm_scale  # (H, N)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs
                    + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    pdl_launch_dependents(PDL)  # the KV walk is done: the next kernel may launch
    # Empty slice: l_i == 0, m_i == -inf -> o = 0, lse = -inf (ignored by the reduce).
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None] * v_scale
    if NUM_SPLITS == 1:  # nothing to merge: write the output, skip the reduce launch
        tl.store(out_ptr + b * stride_outb + head[:, None] * stride_outh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        lse = m_i + tl.log(l_safe)
        lse = tl.where(l_i > 0, lse, float("-inf"))
        o_ptrs = (part_o_ptr + b * stride_ob + head[:, None] * stride_oh + split * stride_os
                  + offs_d[None, :])
        tl.store(o_ptrs, o, mask=h_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + b * stride_lb + head * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_outb, stride_outh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # before any global access (pdl.py)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # 0 for empty splits
    o = tl.load(part_o_ptr + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os
                + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    w_sum = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS_FALLBACK


def default_num_splits(batch_size: int, num_kv_heads: int, max_context_len: int,
                       device: torch.device, min_split_len: int = 256) -> int:
    """Enough splits to give every SM about two programs, none shorter than min_split_len.

    Depends only on shapes (never on seq_lens values), so a captured graph stays valid.
    """
    want = math.ceil(2 * _num_sms(device) / max(1, batch_size * num_kv_heads))
    cap = max(1, math.ceil(max_context_len / min_split_len))
    return max(1, min(want, cap, 64))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                     num_splits: int | None = None, out: torch.Tensor | None = None,
                     block_n: int = 64, sliding_window: int | None = None,
                     num_warps: int = 4, num_stages: int = 2, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """q (B, Hq, D) -> out (B, Hq, D) attending to the first seq_lens[b] cached tokens
    (only the last ``sliding_window`` of them when set); k_scale / v_scale: an FP8 cache's."""
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0 and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, page_table.shape[1] * page_size,
                                        q.device)
    if out is None:
        out = torch.empty_like(q)
    # Partial results only when there is something to merge (else unused placeholders).
    part_shape = (batch, num_q_heads, num_splits, head_dim) if num_splits > 1 else (1, 1, 1, 1)
    part_o = torch.empty(part_shape, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(part_shape[:3], device=q.device, dtype=torch.float32)
    block_d = triton.next_power_of_2(head_dim)
    # tl.dot needs M >= 16 on the GPU; the padded head rows are masked out.
    block_h = max(16, triton.next_power_of_2(group))
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, part_o, part_lse, out, sm_scale * k_scale,
        v_scale, sliding_window or 0, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), page_table.shape[1],
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h,
        BLOCK_N=block_n, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(q),
    )
    if num_splits == 1:
        return out
    _decode_reduce_kernel[(batch, num_q_heads)](
        part_o, part_lse, out,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=4, **pdl_launch(q),
    )
    return out


def gather_kv(cache: torch.Tensor, page_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one row from the paged cache: (length, Hkv, D)."""
    page_size = cache.shape[1]
    num_pages = -(-length // page_size)
    pages = page_table_row[:num_pages].long()
    return gather_pages(cache, pages).reshape(num_pages * page_size, *cache.shape[2:])[:length]


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                           compute_dtype: torch.dtype = torch.float32,
                           sliding_window: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """Reference: gather every row's pages up to the longest row, masked softmax.

    Reads seq_lens on the host (a sync): a reference, not for graphs.
    """
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_len = int(seq_lens.max().item()) if batch else 0
    if max_len == 0:
        return torch.zeros_like(q)
    num_pages = -(-max_len // page_size)
    pages = page_table[:, :num_pages].long()
    k = gather_pages(k_cache, pages).reshape(batch, num_pages * page_size, num_kv_heads, head_dim)
    v = gather_pages(v_cache, pages).reshape(batch, num_pages * page_size, num_kv_heads, head_dim)
    qg = q.to(compute_dtype).view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, from_cache(k, compute_dtype, k_scale)) * sm_scale
    pos = torch.arange(num_pages * page_size, device=q.device)
    valid = pos[None, :] < seq_lens[:, None].to(pos.dtype)  # (B, L)
    if sliding_window:
        valid &= pos[None, :] >= seq_lens[:, None].to(pos.dtype) - sliding_window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty rows -> 0
    out = torch.einsum("bhgl,blhd->bhgd", probs, from_cache(v, compute_dtype, v_scale))
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)
