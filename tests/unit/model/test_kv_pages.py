from __future__ import annotations

import pytest
import torch

from generation_service.engine.kv_cache import DUMMY_PAGE, KVCache, PageAllocator, num_pages_for, page_table_of


def test_allocator_never_hands_out_the_dummy_page():
    allocator = PageAllocator(5)
    assert allocator.num_free_pages == 4 and allocator.num_used_pages == 0
    pages = allocator.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and DUMMY_PAGE not in pages
    assert not allocator.can_allocate(1)
    with pytest.raises(RuntimeError, match="cannot allocate 1 pages: 0 free"):
        allocator.allocate(1)


def test_freed_pages_are_reused_and_double_free_is_refused():
    allocator = PageAllocator(4)
    first = allocator.allocate(2)
    allocator.free(first)
    assert allocator.num_free_pages == 3
    assert set(allocator.allocate(2)) == set(first)
    with pytest.raises(ValueError, match="freed twice"):
        allocator.free([3, 3])
    with pytest.raises(ValueError, match="not an allocatable page"):
        allocator.free([DUMMY_PAGE])


def test_cache_shapes_and_size():
    cache = KVCache(2, 6, 4, 2, 8, torch.bfloat16, "cpu")
    assert cache.layer(1).k.shape == (6, 4, 2, 8) and cache.layer(1).page_size == 4
    assert cache.num_bytes == KVCache.bytes_per_page(2, 4, 2, 8, torch.bfloat16) * 6
    assert num_pages_for(0, 4) == 0 and num_pages_for(4, 4) == 1 and num_pages_for(5, 4) == 2


def test_page_table_rows_are_the_page_lists_padded_with_the_dummy_page():
    table = page_table_of([[7, 3], [], [5, 9, 11]])
    assert table.dtype.name == "int32"
    assert table.tolist() == [[7, 3, DUMMY_PAGE], [DUMMY_PAGE] * 3, [5, 9, 11]]
    assert page_table_of([]).shape == (0, 0)
