"""Fused K/V cache write vs index_copy."""
import pytest
import torch

pytest.importorskip("triton")

from generation_service.kernels.kv_write import write_kv, write_kv_torch  # noqa: E402


def test_write_kv_matches_index_copy():
    num_pages, page_size, heads, dim = 6, 16, 2, 32
    k_cache = torch.randn(num_pages, page_size, heads, dim)
    v_cache = torch.randn_like(k_cache)
    slots = torch.tensor([17, 18, 40, 95, 33], dtype=torch.int64)  # distinct, cross pages
    k = torch.randn(len(slots), heads, dim)
    v = torch.randn_like(k)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_torch(k, v, want_k, want_v, slots)
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_padding_tokens_only_touch_the_dummy_page():
    k_cache = torch.randn(3, 16, 2, 32).half()
    v_cache = torch.randn_like(k_cache)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([20, 0, 0], dtype=torch.int64)  # one real token, two padding
    k = torch.randn(3, 2, 32)
    write_kv(k, k, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 4], k[0].half()) and torch.equal(v_cache[1, 4], k[0].half())
    changed = (k_cache != before_k).any(dim=(2, 3)) | (v_cache != before_v).any(dim=(2, 3))
    assert changed.nonzero().tolist() == [[0, 0], [1, 4]]


def test_slot_ids_for_matches_page_table():
    from generation_service.kernels.kv_write import slot_ids_for
    page_table = torch.tensor([[5, 2, 0], [7, 0, 0]], dtype=torch.int32)
    positions = torch.tensor([15, 16, 17, 3])
    rows = torch.tensor([0, 0, 0, 1])
    assert slot_ids_for(page_table, positions, rows, 16).tolist() == [95, 32, 33, 115]
