"""Attention backends: a small abstract base and two implementations.

The model calls ``backend.decode`` / ``backend.extend`` with the per-layer paged cache
and the step's ``ForwardBatch``; it never imports a kernel module. The torch backend
runs anywhere (CPU tests, debugging); the triton backend imports triton on first use.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import torch


class AttentionMetadata(Protocol):
    """The fields attention reads; ``model.forward_batch.ForwardBatch`` satisfies it."""

    page_table: torch.Tensor  # (B, max_pages) int32, unused entries 0 (dummy page)
    seq_lens: torch.Tensor  # (B,) int32 cached + new tokens after this forward
    extend_lens: torch.Tensor  # (B,) int32 new tokens per row, sum == T


class AttentionBackend(ABC):
    """Attention over a paged KV cache.

    Invariants: k/v caches are (num_pages, page_size, num_kv_heads, head_dim) with page 0
    the dummy page; the new tokens' K/V are in the cache before ``decode``/``extend``;
    every output element is written, rows with seq_len 0 get zeros. FP8 caches come with
    their layer's ``k_scale`` / ``v_scale`` (value = stored * scale; engine/kv_cache.py).
    """

    name: ClassVar[str]

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               batch: AttentionMetadata, sm_scale: float,
               sliding_window: int | None = None, out: torch.Tensor | None = None,
               k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """One query token per row: q (B, Hq, D) -> (B, Hq, D), written into ``out`` if given."""

    @abstractmethod
    def extend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               batch: AttentionMetadata, sm_scale: float, max_extend_len: int | None = None,
               sliding_window: int | None = None, out: torch.Tensor | None = None,
               extend_start: torch.Tensor | None = None, k_scale: float = 1.0,
               v_scale: float = 1.0) -> torch.Tensor:
        """Ragged new tokens q (T, Hq, D), causal over cached prefix + themselves; written
        into ``out`` if given.

        ``max_extend_len`` bounds extend_lens without a host read (needed under graphs);
        ``extend_start`` (B,) int64, the exclusive cumsum of extend_lens, if the caller has it.
        """

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_ids: torch.Tensor, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        """Store k, v (T, Hkv, D) at flattened cache slots (T,) int64."""


class TorchAttentionBackend(AttentionBackend):
    """The references; syncs on the host, so eager mode only."""

    name = "torch"

    def decode(self, q, k_cache, v_cache, batch, sm_scale, sliding_window=None, out=None, k_scale=1.0,
               v_scale=1.0):
        from .decode_attention import decode_attention_torch
        return _into(out, decode_attention_torch(q, k_cache, v_cache, batch.page_table, batch.seq_lens,
                                                 sm_scale, sliding_window=sliding_window, k_scale=k_scale,
                                                 v_scale=v_scale))

    def extend(self, q, k_cache, v_cache, batch, sm_scale, max_extend_len=None,
               sliding_window=None, out=None, extend_start=None, k_scale=1.0, v_scale=1.0):
        from .extend_attention import extend_attention_torch
        return _into(out, extend_attention_torch(q, k_cache, v_cache, batch.page_table, batch.seq_lens,
                                                 batch.extend_lens, sm_scale, sliding_window=sliding_window,
                                                 k_scale=k_scale, v_scale=v_scale))

    def write_kv(self, k, v, k_cache, v_cache, slot_ids, k_scale=1.0, v_scale=1.0):
        from .kv_write import write_kv_torch
        write_kv_torch(k, v, k_cache, v_cache, slot_ids, k_scale, v_scale)


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels; graph safe when ``max_extend_len`` is given to ``extend``."""

    name = "triton"

    def decode(self, q, k_cache, v_cache, batch, sm_scale, sliding_window=None, out=None, k_scale=1.0,
               v_scale=1.0):
        from .decode_attention import decode_attention
        return decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens,
                                sm_scale, sliding_window=sliding_window, out=out, k_scale=k_scale,
                                v_scale=v_scale)

    def extend(self, q, k_cache, v_cache, batch, sm_scale, max_extend_len=None,
               sliding_window=None, out=None, extend_start=None, k_scale=1.0, v_scale=1.0):
        from .extend_attention import extend_attention
        return extend_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens,
                                batch.extend_lens, sm_scale, max_extend_len=max_extend_len,
                                sliding_window=sliding_window, out=out,
                                extend_start=extend_start, k_scale=k_scale, v_scale=v_scale)

    def write_kv(self, k, v, k_cache, v_cache, slot_ids, k_scale=1.0, v_scale=1.0):
        from .kv_write import write_kv
        write_kv(k, v, k_cache, v_cache, slot_ids, k_scale, v_scale)
