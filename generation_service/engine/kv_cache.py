"""Paged KV cache storage and the allocator of its pages.

Layout: for every layer one K and one V tensor shaped
``(num_pages, page_size, num_kv_heads, head_dim)``. A request owns a list of pages (its
page table); token at absolute position ``p`` lives in page ``page_table[p // page_size]``
at offset ``p % page_size``.

Page 0 is the reserved *dummy page*: padding rows of a batch (CUDA-graph buckets) have
all-zero page tables, so their writes land there and never touch a live request's pages.
The allocator therefore hands out ids 1..num_pages-1 only.

FP8 pages (`kv_cache_dtype="fp8"`): e4m3 with one scale per layer for K and one for V
(value = stored * scale); writers divide by the scale and saturate at +-448 (e4m3fn has no
inf), readers multiply. Scales are 1.0 unless the checkpoint calibrated them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Sequence

import numpy as np
import torch

DUMMY_PAGE = 0
KV_FP8 = torch.float8_e4m3fn
KV_FP8_MAX = float(torch.finfo(KV_FP8).max)
KV_DTYPES = ("auto", "fp8")


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pages' element type: "auto" the model's, "fp8" e4m3."""
    if name not in KV_DTYPES:
        raise ValueError(f"kv cache dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    return KV_FP8 if name == "fp8" else model_dtype


def to_cache(values: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """K or V as the cache stores them (the torch writers; the kernels do the same)."""
    if dtype != KV_FP8:
        return values.to(dtype)
    # times the fp32 inverse, as the kernels compute it: the same e4m3 bits
    return (values.float() * (1.0 / scale)).clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """FP8 pages as uint8 for indexing: torch's CPU index kernels do not take float8."""
    return tensor.view(torch.uint8) if tensor.dtype == KV_FP8 else tensor


def gather_pages(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index] for any page dtype."""
    return as_bytes(cache)[index].view(cache.dtype)


def from_cache(values: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached K or V in `dtype` for the torch readers."""
    return values.to(dtype) * scale if values.dtype == KV_FP8 else values.to(dtype)


@dataclass(frozen=True)
class KVLayer:
    """The K and V pages of one layer; what attention reads and writes."""

    k: torch.Tensor  # (num_pages, page_size, num_kv_heads, head_dim)
    v: torch.Tensor  # (num_pages, page_size, num_kv_heads, head_dim)
    k_scale: float = 1.0  # FP8 pages: value = stored * scale
    v_scale: float = 1.0

    @property
    def page_size(self) -> int:
        return self.k.shape[1]


class KVCache:
    """K/V storage for all layers, allocated once up front."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the dummy page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.k_scales = [1.0] * num_layers  # per layer (FP8 pages; 1.0 otherwise)
        self.v_scales = [1.0] * num_layers

    def layer(self, index: int) -> KVLayer:
        return KVLayer(self.k[index], self.v[index], self.k_scales[index], self.v_scales[index])

    def scales(self, index: int) -> dict[str, float]:
        """Layer `index`'s scales as the attention kernels take them (k_scale=, v_scale=)."""
        return {"k_scale": self.k_scales[index], "v_scale": self.v_scales[index]}

    @property
    def num_bytes(self) -> int:
        per_tensor = self.k[0].numel() * self.k[0].element_size()
        return 2 * self.num_layers * per_tensor

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        """Bytes one page costs over all layers, K and V; for sizing the cache to free memory."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * element_size


class PageAllocator:
    """Hands out page ids 1..num_pages-1 (0 is the dummy page); LIFO reuse keeps caches warm."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the dummy page), got {num_pages}")
        self.num_pages = num_pages
        # Reversed so that allocate() pops the lowest ids first.
        self._free: list[int] = list(range(num_pages - 1, DUMMY_PAGE, -1))
        self._is_used = [False] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise RuntimeError(f"cannot allocate {n} pages: {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._is_used[page] = True
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page == DUMMY_PAGE or not 0 < page < self.num_pages:
                raise ValueError(f"page {page} is not an allocatable page")
            if not self._is_used[page]:
                raise ValueError(f"page {page} freed twice")
            self._is_used[page] = False
            self._free.append(page)


def num_pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


def offsets_within(counts: np.ndarray) -> np.ndarray:
    """0..n-1 for each count n, concatenated: [2, 3] -> [0, 1, 0, 1, 2]."""
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def page_table_of(page_lists: Sequence[Sequence[int]]) -> np.ndarray:
    """(B, W) int32 page table of B requests' page lists (W the longest), the rest DUMMY_PAGE;
    in numpy: a torch op per row costs microseconds of dispatch, a step has up to hundreds."""
    counts = np.fromiter((len(pages) for pages in page_lists), dtype=np.int64, count=len(page_lists))
    table = np.full((len(page_lists), int(counts.max(initial=0))), DUMMY_PAGE, dtype=np.int32)
    is_page = np.arange(table.shape[1]) < counts[:, None]  # row-major: the lists' order
    table[is_page] = np.fromiter(chain.from_iterable(page_lists), dtype=np.int32, count=int(counts.sum()))
    return table
