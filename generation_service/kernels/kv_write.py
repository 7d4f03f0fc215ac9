"""Store the new tokens' K and V into the paged cache at their slot ids, one launch.

The torch version is two ``index_copy_`` calls; the kernel does both in one launch (one
program per token, a (Hkv * D) row each), which saves a launch per layer. Padding tokens
carry slot 0 (the dummy page), so several may write there: harmless, nobody reads it.
FP8 caches (engine/kv_cache.py): values divided by the layer's scale, saturated, rounded to e4m3.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from generation_service.engine.kv_cache import KV_FP8, as_bytes
from generation_service.engine.kv_cache import to_cache as to_cache_torch


@triton.jit
def to_cache(x, inv_scale, dst_ty: tl.constexpr, QUANT: tl.constexpr):
    """K or V in the cache's type: QUANT (e4m3 pages) x / scale saturated at 448, else a cast."""
    if QUANT:
        return tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0).to(dst_ty)
    return x.to(dst_ty)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ids_ptr,
                     stride_kt, stride_vt, stride_kc, stride_vc, inv_k_scale, inv_v_scale,
                     ROW: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ids_ptr + t).to(tl.int64)
    for c0 in tl.static_range(0, ROW, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
        tl.store(k_cache_ptr + slot * stride_kc + offs,
                 to_cache(k, inv_k_scale, k_cache_ptr.dtype.element_ty, QUANT), mask=mask)
        tl.store(v_cache_ptr + slot * stride_vc + offs,
                 to_cache(v, inv_v_scale, v_cache_ptr.dtype.element_ty, QUANT), mask=mask)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    # (num_pages, page_size, Hkv, D) -> (num_slots, Hkv * D); needs contiguous tokens.
    return cache.view(cache.shape[0] * cache.shape[1], -1)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_ids: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v (T, Hkv, D) -> k_cache/v_cache at flattened slot ids (T,) int64 (FP8 caches: by
    the layer's scales)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k2, v2 = k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)
    assert k2.stride(1) == 1 and v2.stride(1) == 1
    kc, vc = _flat(k_cache), _flat(v_cache)
    row = kc.shape[1]
    _kv_write_kernel[(num_tokens,)](
        k2, v2, kc, vc, slot_ids, k2.stride(0), v2.stride(0), kc.stride(0), vc.stride(0),
        1.0 / k_scale, 1.0 / v_scale, ROW=row, BLOCK=min(1024, triton.next_power_of_2(row)),
        QUANT=k_cache.dtype == KV_FP8, num_warps=4)


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_ids: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    for values, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = to_cache_torch(values.reshape(values.shape[0], -1), cache.dtype, scale)
        as_bytes(_flat(cache)).index_copy_(0, slot_ids, as_bytes(rows))


def slot_ids_for(page_table: torch.Tensor, positions: torch.Tensor, token_rows: torch.Tensor,
                 page_size: int) -> torch.Tensor:
    """(T,) int64 flattened cache slot of every new token (eager/prefill paths; decode
    gets them from prepare_decode_inputs). token_rows: (T,) row of each token."""
    pages = page_table[token_rows, positions // page_size].long()
    return pages * page_size + positions % page_size
