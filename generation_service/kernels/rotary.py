"""Rotary embedding of q and k (Triton): one launch, a program per token and block of heads.

Rotate-half convention of Hugging Face checkpoints: with x = [x1, x2] halves of a head,
    x1' = x1 cos - x2 sin,   x2' = x2 cos + x1 sin.
cos/sin are (T, head_dim) tables in the activation dtype, as `model.layers.RotaryEmbedding`
builds them (fp32 angles, rounded), and every product and the sum are rounded to the
activation dtype as the torch reference (`model.layers.apply_rope`) rounds them: bit for
bit under the CPU interpreter; compiled for the H200, 77-81% of elements are bit-equal and
the rest differ in the last bf16 bit (the products stay fp32 there; `tests/gpu/test_kernels.py`).

Two entry points over the one kernel:
- `rope_write_kv` (the fused decode forward): q, k, v read straight out of the fused qkv
  projection; rotated q into a new tensor, rotated k and v stored into the paged cache at
  the step's slots (replaces ~12 launches per layer);
- `rope_qk_`: q and k in place at their positions (tables built here from inv_freq).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from generation_service.engine.kv_cache import KV_FP8

from .kv_write import to_cache
from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait


@triton.jit
def _rotate_head(src, dst, cos1, cos2, sin1, sin2, offs, mask, HALF: tl.constexpr,
                 inv_scale, QUANT: tl.constexpr):
    """One head: x * cos + rotate_half(x) * sin, rounded after each op as torch is
    (QUANT: then into an FP8 cache, kv_write.to_cache)."""
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    dt = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    out1 = ((x1f * cos1).to(dt).to(tl.float32) + (-x2f * sin1).to(dt).to(tl.float32)).to(dt)
    out2 = ((x2f * cos2).to(dt).to(tl.float32) + (x1f * sin2).to(dt).to(tl.float32)).to(dt)
    tl.store(dst + offs, to_cache(out1, inv_scale, dst.dtype.element_ty, QUANT), mask=mask)
    tl.store(dst + HALF + offs, to_cache(out2, inv_scale, dst.dtype.element_ty, QUANT), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
                 slot_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs, inv_k_scale, inv_v_scale,
                 QUANT: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SLOTS: tl.constexpr,
                 HAS_V: tl.constexpr, PDL: tl.constexpr):
    """Grid (T, cdiv(Hq, BLOCK_H) + cdiv(Hkv, BLOCK_H)): a program rotates BLOCK_H heads of one
    token, q heads on the first programs of axis 1, k heads (and the matching v heads' copy)
    on the rest. k/v land in row slot_ids[t] of k_out/v_out with HAS_SLOTS, else row t."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # before any global access (pdl.py)
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    mask_d = offs < HALF
    cs = row * stride_cs
    cos1 = tl.load(cos_ptr + cs + offs, mask=mask_d, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + cs + HALF + offs, mask=mask_d, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs + offs, mask=mask_d, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + cs + HALF + offs, mask=mask_d, other=0.0).to(tl.float32)
    if block < q_blocks:
        head = (block * BLOCK_H + tl.arange(0, BLOCK_H))[:, None]
        mask = mask_d & (head < NUM_HEADS)
        _rotate_head(q_ptr + row * stride_qt + head * stride_qh,
                     q_out_ptr + row * stride_qot + head * stride_qoh,
                     cos1, cos2, sin1, sin2, offs, mask, HALF, 1.0, False)
    else:
        kv_head = ((block - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None]
        mask = mask_d & (kv_head < NUM_KV_HEADS)
        dst_row = row
        if HAS_SLOTS:
            dst_row = tl.load(slot_ptr + row).to(tl.int64)
        dst = dst_row * stride_kot + kv_head * stride_koh  # k_out and v_out share a layout
        _rotate_head(k_ptr + row * stride_kt + kv_head * stride_kh, k_out_ptr + dst,
                     cos1, cos2, sin1, sin2, offs, mask, HALF, inv_k_scale, QUANT)
        if HAS_V:
            v_src = v_ptr + row * stride_vt + kv_head * stride_vh
            v_dst = v_out_ptr + dst
            ty = v_out_ptr.dtype.element_ty
            tl.store(v_dst + offs, to_cache(tl.load(v_src + offs, mask=mask), inv_v_scale, ty, QUANT),
                     mask=mask)
            tl.store(v_dst + HALF + offs,
                     to_cache(tl.load(v_src + HALF + offs, mask=mask), inv_v_scale, ty, QUANT), mask=mask)


# Heads a program rotates: 16 (4 warps) is within 0.6 us of the best setting measured up to 768
# tokens for the 1B and 8B shapes, and 9x one head a program at 768
# (H200; docs/serving.md, "Where it stands")
HEADS_PER_PROGRAM, NUM_WARPS = 16, 4


def heads_per_program(num_heads: int) -> tuple[int, int]:
    """(heads a program rotates, its warps)."""
    block = min(triton.next_power_of_2(num_heads), HEADS_PER_PROGRAM)
    return block, max(1, min(NUM_WARPS, block // 4))


def _launch(q, k, v, cos, sin, q_out, k_out, v_out, slot_ids, block_h: int | None = None,
            num_warps: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """q (T, Hq, D), k/v (T, Hkv, D) views with a contiguous last dim; k_out/v_out (N, Hkv, D)
    with the same strides (FP8: stored by k_scale / v_scale); cos/sin (T, D) contiguous rows."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert q.stride(2) == k.stride(2) == q_out.stride(2) == k_out.stride(2) == 1
    if v is not None:
        assert v.stride(2) == 1 and v_out.stride() == k_out.stride()
    if num_tokens == 0:
        return
    half = head_dim // 2
    chosen_h, chosen_warps = heads_per_program(num_heads)
    block_h, num_warps = block_h or chosen_h, num_warps or chosen_warps
    v_in, v_dst = (v, v_out) if v is not None else (k, k_out)  # never read without HAS_V
    grid = (num_tokens, triton.cdiv(num_heads, block_h) + triton.cdiv(num_kv_heads, block_h))
    _rope_kernel[grid](
        q, k, v_in, cos, sin, q_out, k_out, v_dst, slot_ids if slot_ids is not None else cos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v_in.stride(0), v_in.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
        1.0 / k_scale, 1.0 / v_scale, QUANT=k_out.dtype == KV_FP8,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=block_h, HAS_SLOTS=slot_ids is not None, HAS_V=v is not None, num_warps=num_warps,
        **pdl_launch(q))


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_ids: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int, block_h: int | None = None, num_warps: int | None = None,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """qkv (T, (Hq + 2 Hkv) * D) -> rotated q (T, Hq, D); rotated k and v into the cache slots
    (k_cache/v_cache (pages, page_size, Hkv, D) contiguous, slot_ids (T,) flat slot per token;
    FP8 caches by the layer's k_scale / v_scale)."""
    num_tokens = qkv.shape[0]
    assert qkv.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    # (T, H, D) views of the projection: q heads, then k heads, then v heads
    q_in = qkv[:, :q_dim].unflatten(1, (num_heads, head_dim))
    k_in = qkv[:, q_dim:q_dim + kv_dim].unflatten(1, (num_kv_heads, head_dim))
    v_in = qkv[:, q_dim + kv_dim:q_dim + 2 * kv_dim].unflatten(1, (num_kv_heads, head_dim))
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _launch(q_in, k_in, v_in, cos, sin, q, k_cache.view(-1, num_kv_heads, head_dim),
            v_cache.view(-1, num_kv_heads, head_dim), slot_ids, block_h, num_warps, k_scale, v_scale)
    return q


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, D) cos and sin tables in `dtype`: fp32 angles as transformers forms them, rounded."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             inv_freq: torch.Tensor) -> None:
    """In place: q (T, Hq, D), k (T, Hkv, D) views (last dim contiguous) get RoPE at their
    positions (T,). inv_freq: (D/2,) fp32 on q's device (scaling already applied)."""
    cos, sin = rope_cos_sin(positions, inv_freq, q.dtype)
    _launch(q, k, None, cos, sin, q, k, None, None)


def rope_qk_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (out of place), written as transformers computes it."""
    cos, sin = rope_cos_sin(positions, inv_freq, q.dtype)

    def rotate(x):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    return rotate(q), rotate(k)
