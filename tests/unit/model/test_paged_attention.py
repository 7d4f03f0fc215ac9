"""paged_attention_reference against dense causal attention computed without pages."""

from __future__ import annotations

import torch

from generation_service.engine.kv_cache import KVCache
from generation_service.model.attention import paged_attention_reference, write_kv
from generation_service.model.forward_batch import build_forward_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 4, 2, 8, 3


def dense_attention(q, k, v, sliding_window=None):
    """q (n, H, D) at the last n of L positions; k, v (L, KV, D). Plain masked softmax."""
    n, length = q.shape[0], k.shape[0]
    k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    q_pos = torch.arange(length - n, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    mask = k_pos <= q_pos
    if sliding_window:
        mask &= k_pos > q_pos - sliding_window
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM ** 0.5
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def run_rows(seq_lens, extend_lens, page_tables, sliding_window=None, num_padding_rows=0):
    torch.manual_seed(0)
    cache = KVCache(1, 16, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    layer = cache.layer(0)
    keys = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in seq_lens]
    values = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in seq_lens]
    # Cache the already-known prefix of every row, as earlier forwards would have.
    prefix = build_forward_batch([[0] * (s - e) for s, e in zip(seq_lens, extend_lens)], [0] * len(seq_lens),
                                 page_tables)
    write_kv(layer, torch.cat([k[: s - e] for k, s, e in zip(keys, seq_lens, extend_lens)]),
             torch.cat([v[: s - e] for v, s, e in zip(values, seq_lens, extend_lens)]), prefix)
    new_ids = [[0] * e for e in extend_lens] + [[0]] * num_padding_rows
    batch = build_forward_batch(new_ids, [s - e for s, e in zip(seq_lens, extend_lens)] + [0] * num_padding_rows,
                                page_tables + [[]] * num_padding_rows)
    q_rows = [torch.randn(e, NUM_HEADS, HEAD_DIM) for e in extend_lens]
    padding = torch.randn(num_padding_rows, NUM_KV_HEADS, HEAD_DIM)
    write_kv(layer, torch.cat([k[s - e :] for k, s, e in zip(keys, seq_lens, extend_lens)] + [padding]),
             torch.cat([v[s - e :] for v, s, e in zip(values, seq_lens, extend_lens)] + [padding]), batch)
    q = torch.cat(q_rows + [torch.randn(num_padding_rows, NUM_HEADS, HEAD_DIM)])
    out = paged_attention_reference(q, layer, batch, sliding_window=sliding_window)
    expected = [dense_attention(qr, k, v, sliding_window) for qr, k, v in zip(q_rows, keys, values)]
    return cache, out[: sum(extend_lens)], torch.cat(expected)


def test_mixed_prefill_and_decode_rows_over_scattered_pages():
    # Row 0: prefill of 7 tokens; row 1: decode at position 9; row 2: second chunk of 4 tokens.
    # Pages deliberately out of order and interleaved between rows.
    _, out, expected = run_rows([7, 10, 8], [7, 1, 4], [[5, 2, 9], [1, 7, 3, 11], [4, 12, 6]])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_sliding_window():
    _, out, expected = run_rows([11, 12], [11, 1], [[1, 2, 3, 4], [5, 6, 7, 8]], sliding_window=4)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_padding_rows_write_only_the_dummy_page():
    cache, out, expected = run_rows([5, 3], [2, 3], [[1, 2], [3]], num_padding_rows=3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    untouched = range(4, cache.num_pages)
    assert all(cache.k[0][page].abs().sum() == 0 for page in untouched)
    assert cache.k[0][0].abs().sum() > 0  # the padding rows' writes landed in page 0
