"""Store the new tokens' K and V into the paged cache at their slot ids, one launch.

The torch version is two ``index_copy_`` calls; the kernel does both in one launch (one
program per token, a (Hkv * D) row each), which saves a launch per layer. Padding tokens
carry slot 0 (the dummy page), so several may write there: harmless, nobody reads it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ids_ptr,
                     stride_kt, stride_vt, stride_kc, stride_vc,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ids_ptr + t).to(tl.int64)
    for c0 in tl.static_range(0, ROW, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
        tl.store(k_cache_ptr + slot * stride_kc + offs, k.to(k_cache_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(v_cache_ptr + slot * stride_vc + offs, v.to(v_cache_ptr.dtype.element_ty),
                 mask=mask)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    # (num_pages, page_size, Hkv, D) -> (num_slots, Hkv * D); needs contiguous tokens.
    return cache.view(cache.shape[0] * cache.shape[1], -1)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_ids: torch.Tensor) -> None:
    """k, v (T, Hkv, D) -> k_cache/v_cache at flattened slot ids (T,) int64."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k2, v2 = k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)
    assert k2.stride(1) == 1 and v2.stride(1) == 1
    kc, vc = _flat(k_cache), _flat(v_cache)
    row = kc.shape[1]
    _kv_write_kernel[(num_tokens,)](
        k2, v2, kc, vc, slot_ids, k2.stride(0), v2.stride(0), kc.stride(0), vc.stride(0),
        ROW=row, BLOCK=min(1024, triton.next_power_of_2(row)), num_warps=4)


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_ids: torch.Tensor) -> None:
    _flat(k_cache).index_copy_(0, slot_ids, k.reshape(k.shape[0], -1).to(k_cache.dtype))
    _flat(v_cache).index_copy_(0, slot_ids, v.reshape(v.shape[0], -1).to(v_cache.dtype))


def slot_ids_for(page_table: torch.Tensor, positions: torch.Tensor, token_rows: torch.Tensor,
                 page_size: int) -> torch.Tensor:
    """(T,) int64 flattened cache slot of every new token (eager/prefill paths; decode
    gets them from prepare_decode_inputs). token_rows: (T,) row of each token."""
    pages = page_table[token_rows, positions // page_size].long()
    return pages * page_size + positions % page_size
