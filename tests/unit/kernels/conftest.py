"""Kernel tests on the CPU: Triton's interpreter runs the kernels (tiny shapes only).

NOTE: TRITON_INTERPRET must be set before any kernel module is imported, because
@triton.jit picks interpreter or compiler when it decorates, once per process. On a
CUDA machine it stays unset, so tests/gpu/test_kernels.py in the same pytest run gets
compiled kernels, and these CPU-tensor tests skip (the GPU tests cover the same
comparisons). The interpreter's bf16 tl.dot is broken (numpy has no bf16), so these
tests use fp32/fp16; bf16 is covered on the GPU.
"""
import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if not HAS_CUDA:
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="CUDA present: interpreter off; see tests/gpu/test_kernels.py")
    for item in items:
        if here in Path(str(item.fspath)).parents and "compile_sm90" not in item.name:
            item.add_marker(skip)


@pytest.fixture
def make_paged():
    """Factory: random paged K/V cache and page table for the given per-row lengths.

    Pages are distinct, shuffled and never 0; unused page-table entries are 0 (the dummy
    page), which holds random junk like every other page.
    """
    def make(seq_lens, *, page_size=16, num_kv_heads=2, head_dim=32, dtype=torch.float32,
             spare_pages=3, seed=None):
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        pages_per_row = [-(-n // page_size) for n in seq_lens]
        num_pages = 1 + sum(pages_per_row) + spare_pages
        width = max(max(pages_per_row, default=1), 1) + 1
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
        ids = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
        page_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
        for row, count in enumerate(pages_per_row):
            page_table[row, :count] = torch.tensor(ids[:count], dtype=torch.int32)
            ids = ids[count:]
        return k_cache, v_cache, page_table, torch.tensor(seq_lens, dtype=torch.int32)
    return make


@pytest.fixture
def rel_err():
    """||out - ref|| / ||ref|| in float64."""
    def err(out: torch.Tensor, ref: torch.Tensor) -> float:
        diff = (out.double() - ref.double()).norm()
        return float(diff / ref.double().norm().clamp_min(1e-30))
    return err


def _same_fp8(ours: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal e4m3, except where Triton's interpreter misrounds (CPU only; compiled kernels
    are bit-equal in tests/gpu/test_fp8.py): a value whose rounding carries into the exponent
    comes out one binade low (-31.1 -> -16 instead of -32), and a few land one step off, as by
    a double rounding."""
    ours, want = ours.float(), want.float()
    differ = ours != want
    if torch.cuda.is_available():
        assert not differ.any()
    carried = (want.abs().log2() == want.abs().log2().round()) & (ours == want / 2)
    one_step = (ours - want).abs() <= (2 ** -3 * want.abs()).clamp(min=2 ** -9)  # 2^-9: the subnormal step
    bad = differ & ~carried & ~one_step
    assert not bad.any(), list(zip(ours[bad].tolist(), want[bad].tolist()))


@pytest.fixture
def same_fp8():
    """Asserts two e4m3 tensors equal as the kernels' writes must be (`_same_fp8`)."""
    return _same_fp8
