"""Extend (prefill / verify) attention kernel vs the torch references."""
import pytest
import torch

pytest.importorskip("triton")

from generation_service.kernels.extend_attention import (  # noqa: E402
    extend_attention, extend_attention_torch, max_tiles, tile_array)

# (seq_len, extend_len): full prefill, prefix crossing pages, one token, padding row,
# verify-style 4 tokens over a cached prefix.
ROWS = [(20, 20), (37, 5), (17, 1), (0, 0), (50, 4)]


def _ragged_q(rows, num_q_heads, head_dim, dtype=torch.float32):
    num_tokens = sum(ext for _, ext in rows)
    return torch.randn(num_tokens, num_q_heads, head_dim).to(dtype)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_m", [16, None])
def test_extend_matches_reference(make_paged, rel_err, group, block_m):
    k_cache, v_cache, page_table, seq_lens = make_paged([s for s, _ in ROWS])
    extend_lens = torch.tensor([e for _, e in ROWS], dtype=torch.int32)
    q = _ragged_q(ROWS, k_cache.shape[2] * group, k_cache.shape[3])
    out = torch.full_like(q, float("nan"))
    extend_attention(q, k_cache, v_cache, page_table, seq_lens, extend_lens, 0.2,
                     max_extend_len=20, out=out, block_m=block_m, block_n=16)
    ref = extend_attention_torch(q.double(), k_cache.double(), v_cache.double(), page_table,
                                 seq_lens, extend_lens, 0.2, compute_dtype=torch.float64)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5


def test_extend_fp16_sliding_window(make_paged, rel_err):
    k_cache, v_cache, page_table, seq_lens = make_paged([s for s, _ in ROWS],
                                                        dtype=torch.float16)
    extend_lens = torch.tensor([e for _, e in ROWS], dtype=torch.int32)
    q = _ragged_q(ROWS, 8, k_cache.shape[3], torch.float16)
    out = extend_attention(q, k_cache, v_cache, page_table, seq_lens, extend_lens, 0.2,
                           block_m=16, block_n=16, sliding_window=7)
    ref = extend_attention_torch(q.double(), k_cache.double(), v_cache.double(), page_table,
                                 seq_lens, extend_lens, 0.2, compute_dtype=torch.float64,
                                 sliding_window=7)
    assert rel_err(out, ref) < 2e-3


def test_extend_matches_model_reference(make_paged, rel_err):
    attention = pytest.importorskip("generation_service.model.attention")
    if not hasattr(attention, "paged_attention_reference"):
        pytest.skip("the model's attention reference moved")
    from generation_service.engine.kv_cache import KVLayer
    from generation_service.model.forward_batch import ForwardBatch
    rows = [(37, 5), (18, 18)]
    k_cache, v_cache, page_table, seq_lens = make_paged([s for s, _ in rows])
    extend_lens = torch.tensor([e for _, e in rows], dtype=torch.int32)
    q = _ragged_q(rows, 8, k_cache.shape[3])
    positions = torch.cat([torch.arange(s - e, s) for s, e in rows])
    batch = ForwardBatch(input_ids=torch.zeros(len(positions), dtype=torch.int64),
                         positions=positions, page_table=page_table, seq_lens=seq_lens,
                         extend_lens=extend_lens, logits_indices=torch.arange(len(positions)))
    ref = attention.paged_attention_reference(q, KVLayer(k_cache, v_cache), batch, scale=0.2)
    out = extend_attention(q, k_cache, v_cache, page_table, seq_lens, extend_lens, 0.2,
                           block_m=32, block_n=16)
    assert rel_err(out, ref) < 1e-5


def test_padding_tail_tokens_get_zeros(make_paged, rel_err):
    rows = [(30, 3), (0, 0), (9, 2)]
    k_cache, v_cache, page_table, seq_lens = make_paged([s for s, _ in rows])
    extend_lens = torch.tensor([e for _, e in rows], dtype=torch.int32)
    q = torch.randn(5 + 7, 8, k_cache.shape[3])  # 5 real tokens, a 7-token padding tail
    out = torch.full_like(q, float("nan"))
    extend_attention(q, k_cache, v_cache, page_table, seq_lens, extend_lens, 0.2,
                     max_extend_len=4, out=out, block_n=16)
    ref = extend_attention_torch(q[:5].double(), k_cache.double(), v_cache.double(),
                                 page_table, seq_lens, extend_lens, 0.2,
                                 compute_dtype=torch.float64)
    assert rel_err(out[:5], ref) < 1e-5
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))


def test_tile_array_lists_every_tile_once_the_latest_m_blocks_first():
    """Rows of 0, 1, 40 and 17 new tokens, 4 heads a kv head, 32-row tiles: cdiv(n * 4, 32)
    tiles each; blocks in descending order (the ones that see the most keys start first)."""
    lens = [0, 1, 40, 17]
    rows, blocks = tile_array(lens, 4, 32)
    want = {(row, block) for row, n in enumerate(lens) for block in range(-(-n * 4 // 32))}
    assert sorted(zip(rows.tolist(), blocks.tolist())) == sorted(want)
    assert blocks.tolist() == sorted(blocks.tolist(), reverse=True)
    assert len(rows) <= max_tiles(sum(lens), len(lens), 4, 32)
