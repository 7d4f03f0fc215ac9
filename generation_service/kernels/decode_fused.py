"""Fused element-wise steps of a decode layer (Triton): fewer, larger launches per layer.

Measured on the H200 (docs/gpu.md, v1): a decode layer of torch ops around the GEMMs and the
attention kernels launched ~36 kernels, ~80 us per layer of launch-bound time regardless of
model size. These three kernels cut a layer to ~10 launches:

- `add_rmsnorm`: residual += delta, then RMSNorm of the new residual (one launch per norm,
  replaces the residual add and the ~7 launches of the torch RMSNorm);
- `rope_write_kv`: RoPE of q and k straight out of the fused qkv projection, rotated k and
  v stored into the paged cache at the step's slots (replaces ~12 launches);
- `silu_mul`: silu(gate) * up out of the fused gate_up projection.

Rounding follows the torch reference op by op (bf16 after every torch op), so results differ
from the unfused path only by fp32 summation order inside the norm.
Used by `engine/decode_forward.py` (the fused decode forward).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, n_cols, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * n_cols + offs, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the bf16 residual add
        tl.store(new_res_ptr + row * n_cols + offs, h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, axis=0) / n_cols
    normed = (hf * tl.rsqrt(var + eps)).to(x.dtype).to(tl.float32)  # cast back before the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + offs, (normed * w).to(x.dtype), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x) * weight, residual + x); without residual: (rmsnorm(x) * w, x)."""
    rows, cols = x.shape
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    out = torch.empty_like(x)
    new_res = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(cols)
    _add_rmsnorm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, new_res,
                                 cols, eps, HAS_RES=residual is not None, BLOCK=block,
                                 num_warps=8 if block >= 4096 else 4)
    return out, new_res


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_qkv, stride_cs,
                          NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, HALF)
    c1 = tl.load(cos_ptr + row * stride_cs + offs).to(tl.float32)
    c2 = tl.load(cos_ptr + row * stride_cs + HALF + offs).to(tl.float32)
    s1 = tl.load(sin_ptr + row * stride_cs + offs).to(tl.float32)
    s2 = tl.load(sin_ptr + row * stride_cs + HALF + offs).to(tl.float32)
    src = qkv_ptr + row * stride_qkv + head * HEAD_DIM  # q heads, then k heads, then v heads
    x1 = tl.load(src + offs)
    x2 = tl.load(src + HALF + offs)
    dt = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, rounded to bf16 after each op as the torch reference is
    out1 = ((x1f * c1).to(dt).to(tl.float32) + (-x2f * s1).to(dt).to(tl.float32)).to(dt)
    out2 = ((x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)).to(dt)
    if head < NUM_HEADS:
        dst = q_out_ptr + (row * NUM_HEADS + head) * HEAD_DIM
        tl.store(dst + offs, out1)
        tl.store(dst + HALF + offs, out2)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slot_ptr + row).to(tl.int64)
        dst = k_cache_ptr + (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
        tl.store(dst + offs, out1.to(k_cache_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, out2.to(k_cache_ptr.dtype.element_ty))
        v_src = src + NUM_KV_HEADS * HEAD_DIM
        v_dst = v_cache_ptr + (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
        tl.store(v_dst + offs, tl.load(v_src + offs).to(v_cache_ptr.dtype.element_ty))
        tl.store(v_dst + HALF + offs, tl.load(v_src + HALF + offs).to(v_cache_ptr.dtype.element_ty))


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_ids: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int) -> torch.Tensor:
    """qkv (T, (Hq + 2 Hkv) * D) -> rotated q (T, Hq, D); rotated k and v into the cache slots."""
    num_tokens = qkv.shape[0]
    assert qkv.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_write_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, cos, sin, q, k_cache, v_cache, slot_ids, qkv.stride(0), cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        num_warps=1)
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(gu_ptr + row * 2 * n_cols + offs, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * 2 * n_cols + n_cols + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu, rounded
    tl.store(out_ptr + row * n_cols + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) = [gate | up] -> silu(gate) * up (T, I)."""
    rows, width = gate_up.shape
    assert gate_up.is_contiguous()
    n_cols = width // 2
    out = torch.empty(rows, n_cols, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n_cols, block))](gate_up, out, n_cols, BLOCK=block, num_warps=4)
    return out
