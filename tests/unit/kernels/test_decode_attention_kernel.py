"""Paged decode attention kernel vs the torch references."""
import pytest
import torch

pytest.importorskip("triton")

from generation_service.kernels.decode_attention import (  # noqa: E402
    decode_attention, decode_attention_torch, default_num_splits)

# Lengths cross page boundaries (16) and split boundaries; 0 is a padding row.
SEQ_LENS = [1, 15, 16, 17, 0, 70]


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(make_paged, rel_err, group, num_splits):
    k_cache, v_cache, page_table, seq_lens = make_paged(SEQ_LENS)
    num_q_heads = k_cache.shape[2] * group
    q = torch.randn(len(SEQ_LENS), num_q_heads, k_cache.shape[3])
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    decode_attention(q, k_cache, v_cache, page_table, seq_lens, 0.17,
                     num_splits=num_splits, out=out, block_n=16)
    ref = decode_attention_torch(q.double(), k_cache.double(), v_cache.double(), page_table,
                                 seq_lens, 0.17, compute_dtype=torch.float64)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(out[SEQ_LENS.index(0)], torch.zeros_like(out[0]))


def test_decode_single_row_many_splits_page_size_8(make_paged, rel_err):
    k_cache, v_cache, page_table, seq_lens = make_paged([150], page_size=8)
    q = torch.randn(1, 8, k_cache.shape[3])
    out = decode_attention(q, k_cache, v_cache, page_table, seq_lens, 0.17, num_splits=5,
                           block_n=16)
    ref = decode_attention_torch(q.double(), k_cache.double(), v_cache.double(), page_table,
                                 seq_lens, 0.17, compute_dtype=torch.float64)
    assert rel_err(out, ref) < 1e-5


def test_decode_fp16_and_sliding_window(make_paged, rel_err):
    k_cache, v_cache, page_table, seq_lens = make_paged(SEQ_LENS, dtype=torch.float16)
    q = torch.randn(len(SEQ_LENS), 8, k_cache.shape[3]).half()
    out = decode_attention(q, k_cache, v_cache, page_table, seq_lens, 0.17, num_splits=2,
                           block_n=16, sliding_window=20)
    ref = decode_attention_torch(q.double(), k_cache.double(), v_cache.double(), page_table,
                                 seq_lens, 0.17, compute_dtype=torch.float64,
                                 sliding_window=20)
    assert out.dtype == torch.float16
    assert rel_err(out, ref) < 2e-3


def test_decode_matches_model_reference(make_paged, rel_err):
    attention = pytest.importorskip("generation_service.model.attention")
    if not hasattr(attention, "paged_attention_reference"):
        pytest.skip("the model's attention reference moved")
    from generation_service.engine.kv_cache import KVLayer
    from generation_service.model.forward_batch import ForwardBatch
    lens = [5, 33, 16]
    k_cache, v_cache, page_table, seq_lens = make_paged(lens)
    q = torch.randn(len(lens), 8, k_cache.shape[3])
    batch = ForwardBatch(
        input_ids=torch.zeros(len(lens), dtype=torch.int64),
        positions=(seq_lens - 1).long(), page_table=page_table, seq_lens=seq_lens,
        extend_lens=torch.ones(len(lens), dtype=torch.int32),
        logits_indices=torch.arange(len(lens)))
    ref = attention.paged_attention_reference(q, KVLayer(k_cache, v_cache), batch, scale=0.1)
    out = decode_attention(q, k_cache, v_cache, page_table, seq_lens, 0.1, block_n=16)
    assert rel_err(out, ref) < 1e-5


def test_num_splits_depends_on_shapes_only():
    cpu = torch.device("cpu")
    assert default_num_splits(1, 8, 8192, cpu) > 1  # long context, tiny batch: split
    assert default_num_splits(128, 8, 8192, cpu) == 1  # the batch fills the GPU alone
    assert default_num_splits(1, 8, 100, cpu) == 1  # nothing to split
