"""Attention over the paged KV cache, in plain torch.

This is the *reference*: the GPU Triton kernels are tested against it, so it favours
clarity over speed (one Python iteration per row, fp32 math, no fused tricks).

Semantics, per row b with ``n = extend_lens[b]`` new tokens and ``L = seq_lens[b]``:
  - the row's keys/values are positions 0..L-1, read through ``page_table[b]``;
  - the new token at position p attends to keys at positions k with k <= p
    (and p - k < sliding_window when a window is set);
  - query head h reads kv head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).
"""

from __future__ import annotations

import torch

from generation_service.engine.kv_cache import KVLayer, as_bytes, from_cache, gather_pages, to_cache
from generation_service.model.forward_batch import ForwardBatch


def write_kv(kv_layer: KVLayer, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
    """Store the new tokens' k, v (T, num_kv_heads, head_dim) at their positions' page slots.

    Padding rows have page table entries 0, so they write into the dummy page.
    """
    page_size = kv_layer.page_size
    pages = batch.page_table[batch.token_rows, batch.positions // page_size].long()  # (T,)
    offsets = batch.positions % page_size  # (T,)
    as_bytes(kv_layer.k)[pages, offsets] = as_bytes(to_cache(k, kv_layer.k.dtype, kv_layer.k_scale))
    as_bytes(kv_layer.v)[pages, offsets] = as_bytes(to_cache(v, kv_layer.v.dtype, kv_layer.v_scale))


def gather_row_kv(kv_layer: KVLayer, pages: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions 0..seq_len-1 of one row: two fp32 (seq_len, num_kv_heads, head_dim)."""
    num_kv_heads, head_dim = kv_layer.k.shape[2:]
    num_pages = -(-seq_len // kv_layer.page_size)
    used = pages[:num_pages].long()
    k = gather_pages(kv_layer.k, used).reshape(-1, num_kv_heads, head_dim)[:seq_len]
    v = gather_pages(kv_layer.v, used).reshape(-1, num_kv_heads, head_dim)[:seq_len]
    return from_cache(k, torch.float32, kv_layer.k_scale), from_cache(v, torch.float32, kv_layer.v_scale)


def paged_attention_reference(
    q: torch.Tensor,
    kv_layer: KVLayer,
    batch: ForwardBatch,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens' queries over each row's cached keys and values.

    q: (T, num_heads, head_dim), already rotated; the new tokens' k/v must already be written
    (``write_kv``). Returns (T, num_heads, head_dim) in q's dtype. Math runs in fp32.
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_layer.k.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.zeros_like(q)
    start = 0
    for row, (n, seq_len) in enumerate(zip(batch.extend_lens.tolist(), batch.seq_lens.tolist())):
        if n == 0:
            continue
        k, v = gather_row_kv(kv_layer, batch.page_table[row], seq_len)
        k = k.float().repeat_interleave(group, dim=1)  # (L, num_heads, head_dim)
        v = v.float().repeat_interleave(group, dim=1)
        q_row = q[start : start + n].float()  # (n, num_heads, head_dim)
        q_pos = batch.positions[start : start + n]
        k_pos = torch.arange(seq_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # (n, L)
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q_row, k) * scale  # (num_heads, n, L)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + n] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        start += n
    return out
