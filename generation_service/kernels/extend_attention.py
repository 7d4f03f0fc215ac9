"""Extend (prefill / speculative-verify) attention over the paged KV cache.

Row b has ``extend_lens[b]`` new query tokens at absolute positions
``prefix_len .. seq_lens[b] - 1`` where ``prefix_len = seq_lens[b] - extend_lens[b]``; their
K/V are already in the cache. Query i of the row attends to cache positions
``0 .. prefix_len + i`` (causal over the new tokens, full over the cached prefix).

q / out are ragged and row-major: (T, Hq, D) with row b's tokens at
``extend_start[b] .. extend_start[b] + extend_lens[b] - 1`` (exclusive cumsum). Tokens
past sum(extend_lens) (the padding tail of a captured graph's buffers) get zeros.

GQA: a program owns one kv head and packs (token, group head) pairs into the M rows of
its tile (row r -> token r // GROUP, head r % GROUP), so each K/V tile is loaded once
for the whole group; for verify (k+1 tokens) this fills the tile with few tokens.
Grid (B, num_kv_heads, cdiv(max_extend_len * GROUP, BLOCK_M)); ``max_extend_len`` is a
host int so the launch is graph safe (programs past a row's extent return at once). The
captured mixed steps (engine/mixed_graphs.py) cannot bound a row's length below the whole step's
tokens, which would launch B x T x GROUP / BLOCK_M programs mostly to return: they launch
`extend_attention_tiles` instead, one program per (tile of a host-made list, kv head).
FP8 pages are read as decode_attention reads them (k's scale in sm_scale, v's on the output).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from generation_service.engine.kv_cache import from_cache

from .decode_attention import gather_kv


@triton.jit
def _zero_tail(o_ptr, extend_lens_ptr, extend_start_ptr, batch, num_tokens, kvh, m_block,
               stride_ot, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):
    """Zero this kv head's q heads for tokens past sum(extend_lens) (a graph's padding
    tail), which no row owns; programs along grid axis 2 interleave over the tokens."""
    total = tl.load(extend_start_ptr + batch - 1) + tl.load(extend_lens_ptr + batch - 1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
    zero = tl.zeros([BLOCK_G, BLOCK_D], tl.float32).to(o_ptr.dtype.element_ty)
    head = kvh * GROUP + offs_g
    for t in range(total + m_block, num_tokens, tl.num_programs(2)):
        tl.store(o_ptr + t * stride_ot + head[:, None] * stride_oh + offs_d[None, :], zero,
                 mask=mask)


@triton.jit
def _attend_block(q, m_i, l_i, acc, k_ptr, v_ptr, pt_row, n0, kv_end, q_pos, first_visible,
                  kvh, sm_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                  stride_vh, max_pages, offs_d, d_mask, MASKED: tl.constexpr,
                  BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """One K/V block of the online softmax. MASKED=False: every key of the block is
    visible to every row (and inside the row's length), so no mask is built."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    col = tl.minimum(offs_n // PAGE_SIZE, max_pages - 1)
    page = tl.load(pt_row + col, mask=n_mask, other=0).to(tl.int64)
    slot = offs_n % PAGE_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_ks
                + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k.to(q.dtype))) * sm_scale  # (M, N)
    if MASKED:
        visible = ((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
                   & (offs_n[None, :] >= first_visible[:, None]))
        qk = tl.where(visible, qk, float("-inf"))
    # A row may see nothing in a masked block (window): keep exp() off -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs
                + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc


# NOTE: rows, tokens and the page table's width change from one eager (mixed) step to the next;
# specialising on them (== 1, % 16) would recompile mid-serving.
@triton.jit(do_not_specialize=["batch", "num_tokens", "stride_ptb", "max_pages"])
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, page_table_ptr, seq_lens_ptr, extend_lens_ptr,
    extend_start_ptr, sm_scale, v_scale, window, batch, num_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ptb, max_pages, tile_rows_ptr, tile_blocks_ptr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, TILED: tl.constexpr,
):
    if TILED:  # grid (kv heads, tiles of the host's list: (row, m block), row -1 = padding)
        kvh = tl.program_id(0)
        b = tl.load(tile_rows_ptr + tl.program_id(1))
        if b < 0:
            return
        m_block = tl.load(tile_blocks_ptr + tl.program_id(1))
    else:
        kvh = tl.program_id(1)
        b = tl.program_id(0)
        m_block = tl.program_id(2)
        if b == batch:  # the extra row of programs: the padding tail
            _zero_tail(o_ptr, extend_lens_ptr, extend_start_ptr, batch, num_tokens, kvh, m_block,
                       stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_D, BLOCK_G)
            return
    extend_len = tl.load(extend_lens_ptr + b)
    if m_block * BLOCK_M >= extend_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix_len = seq_len - extend_len
    q_start = tl.load(extend_start_ptr + b).to(tl.int64)

    offs_r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = offs_r // GROUP
    head = kvh * GROUP + offs_r % GROUP
    r_mask = offs_r < extend_len * GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_mask = r_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=q_mask, other=0.0)  # (M, D)
    q_pos = prefix_len + tok  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The last query of this tile sees positions up to prefix_len + max tok.
    last_tok = tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // GROUP, extend_len - 1)
    kv_end = prefix_len + last_tok + 1
    # Sliding window (window > 0): query at p sees keys p - window + 1 .. p.
    first_visible = tl.where(window > 0, q_pos - window + 1, 0)  # (M,)
    kv_start = tl.where(window > 0, tl.maximum(prefix_len + (m_block * BLOCK_M) // GROUP
                                               - window + 1, 0), 0)
    pt_row = page_table_ptr + b.to(tl.int64) * stride_ptb
    # Keys below the tile's first query position are visible to every row (no window):
    # those whole blocks skip the mask; the rest, and every block under a window, mask.
    first_tok = (m_block * BLOCK_M) // GROUP
    full_end = tl.where(window > 0, kv_start, (prefix_len + first_tok + 1) // BLOCK_N * BLOCK_N)
    for n0 in range(kv_start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, k_ptr, v_ptr, pt_row, n0, kv_end, q_pos, first_visible, kvh,
            sm_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            max_pages, offs_d, d_mask, False, BLOCK_N, PAGE_SIZE)
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, k_ptr, v_ptr, pt_row, n0, kv_end, q_pos, first_visible, kvh,
            sm_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            max_pages, offs_d, d_mask, True, BLOCK_N, PAGE_SIZE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    tl.store(o_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
             + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask)


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, seq_lens: torch.Tensor,
                     extend_lens: torch.Tensor, sm_scale: float,
                     max_extend_len: int | None = None, out: torch.Tensor | None = None,
                     block_m: int | None = None, block_n: int = 64,
                     sliding_window: int | None = None, num_warps: int | None = None,
                     num_stages: int = 2, extend_start: torch.Tensor | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q (T, Hq, D) ragged new tokens -> out (T, Hq, D).

    Pass ``max_extend_len`` (an upper bound on extend_lens) under CUDA graphs; without it
    the wrapper reads extend_lens.max() on the host. ``extend_start`` (B,) int64, the
    exclusive cumsum of extend_lens, saves a launch per call when the caller has it.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0 and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    group = num_q_heads // num_kv_heads
    batch = seq_lens.shape[0]
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max().item()) if batch else 0
    if out is None:
        out = torch.empty_like(q)
    if batch == 0 or max_extend_len == 0:
        return out
    if extend_start is None:
        extend_start = torch.cumsum(extend_lens, 0, dtype=torch.int64) - extend_lens
    block_d = triton.next_power_of_2(head_dim)
    rows = max_extend_len * group  # (token, head) rows of the longest row
    if block_m is None:  # prefill: big tiles reuse K/V; verify: no idle rows
        block_m = 128 if rows >= 512 else max(16, min(64, triton.next_power_of_2(rows)))
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    grid = (batch + 1, num_kv_heads, triton.cdiv(rows, block_m))  # + 1: padding tail
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, seq_lens, extend_lens, extend_start, sm_scale * k_scale,
        v_scale, sliding_window or 0, batch, num_tokens, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), page_table.shape[1], extend_lens, extend_lens,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE_SIZE=page_size, BLOCK_G=triton.next_power_of_2(group), TILED=False, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def tile_array(extend_lens: np.ndarray, group: int, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, m blocks), int64, of every tile `extend_attention_tiles` must run: cdiv(n * group,
    block_m) tiles for a row of n new tokens, none for a row of 0; the latest m blocks, which see
    the most keys, first (the GPU starts programs in order: the longest do not start last)."""
    counts = -(-np.asarray(extend_lens, dtype=np.int64) * group // block_m)
    rows = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    blocks = np.arange(len(rows), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    order = np.argsort(-blocks, kind="stable")
    return rows[order], blocks[order]


def max_tiles(num_tokens: int, num_rows: int, group: int, block_m: int) -> int:
    """An upper bound of len(tile_array(...)[0]) for num_tokens new tokens over num_rows rows."""
    return -(-num_tokens * group // block_m) + num_rows


def extend_attention_tiles(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                           extend_start: torch.Tensor, tile_rows: torch.Tensor, tile_blocks: torch.Tensor,
                           sm_scale: float, block_m: int, out: torch.Tensor, block_n: int = 64,
                           sliding_window: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """`extend_attention` over a host-made tile list (`tile_array`, padded with row -1): one
    program per (tile, kv head), so the grid is fixed by the list's length, not by the rows'
    lengths -- graph safe for any mix of rows up to that many tiles. extend_start (B,) int64:
    each row's first token in q. Tokens no tile covers are left as they are in `out`."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0 and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    group = num_q_heads // num_kv_heads
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    if num_stages is None:  # one stage at head_dim 64: ~0.8x the time of two on an H200
        num_stages = 1 if head_dim <= 64 else 2
    # kv heads on axis 0: programs start tile by tile, in the list's order (tile_array)
    _extend_kernel[(num_kv_heads, tile_rows.shape[0], 1)](
        q, k_cache, v_cache, out, page_table, seq_lens, extend_lens, extend_start, sm_scale * k_scale,
        v_scale, sliding_window or 0, seq_lens.shape[0], num_tokens, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), page_table.shape[1], tile_rows, tile_blocks,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=block_m,
        BLOCK_N=block_n, PAGE_SIZE=page_size, BLOCK_G=triton.next_power_of_2(group), TILED=True,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def extend_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor,
                           extend_lens: torch.Tensor, sm_scale: float,
                           compute_dtype: torch.dtype = torch.float32,
                           sliding_window: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """Reference: one row at a time, explicit causal mask over the absolute positions."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    start = 0
    for b, (seq_len, ext) in enumerate(zip(seq_lens.tolist(), extend_lens.tolist())):
        if ext == 0:
            continue
        k = from_cache(gather_kv(k_cache, page_table[b], seq_len), compute_dtype, k_scale)  # (L, Hkv, D)
        v = from_cache(gather_kv(v_cache, page_table[b], seq_len), compute_dtype, v_scale)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qb = q[start:start + ext].to(compute_dtype)  # (E, Hq, D)
        scores = torch.einsum("ehd,lhd->hel", qb, k) * sm_scale
        q_pos = torch.arange(seq_len - ext, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        causal = k_pos[None, :] <= q_pos[:, None]
        if sliding_window:
            causal &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~causal[None], float("-inf"))
        out[start:start + ext] = torch.einsum(
            "hel,lhd->ehd", torch.softmax(scores, -1), v).to(q.dtype)
        start += ext
    return out
