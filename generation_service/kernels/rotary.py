"""Rotary embedding of q and k in place, one launch, with Qwen3's per-head q/k RMSNorm
optionally fused in front.

Rotate-half convention of Hugging Face checkpoints: with x = [x1, x2] halves of a head,
    x1' = x1 cos - x2 sin,   x2' = x2 cos + x1 sin,   angle = position * inv_freq[j].
The angle is the same fp32 product transformers forms and cos/sin are taken in fp32;
transformers then rounds cos/sin to bf16 before multiplying, this kernel does not, so
results agree within bf16 rounding, not bit for bit. No cos/sin table is materialised.
One program per token covers all its q heads and kv heads: (H, head_dim / 2) tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, norm_w1, norm_w2, eps,
                  HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    ptr1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:  # per-head RMSNorm over the full head (both halves), as transformers
        inv_rms = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)
        a = (a * inv_rms[:, None]).to(dtype).to(tl.float32) * norm_w1[None, :]
        b = (b * inv_rms[:, None]).to(dtype).to(tl.float32) * norm_w2[None, :]
        a = a.to(dtype).to(tl.float32)
        b = b.to(dtype).to(tl.float32)
    out1 = a * cos[None, :] - b * sin[None, :]
    out2 = b * cos[None, :] + a * sin[None, :]
    tl.store(ptr1, out1.to(dtype), mask=mask)
    tl.store(ptr1 + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, positions_ptr, inv_freq_ptr, q_norm_ptr, k_norm_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, num_q_heads, num_kv_heads, eps,
                 HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                 BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    pos = tl.load(positions_ptr + t).to(tl.float32)
    angle = pos * tl.load(inv_freq_ptr + offs_d, mask=d_mask, other=0.0)
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    qw1 = cos  # placeholders when there is no norm
    qw2 = cos
    kw1 = cos
    kw2 = cos
    if HAS_NORM:
        qw1 = tl.load(q_norm_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        qw2 = tl.load(q_norm_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        kw1 = tl.load(k_norm_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        kw2 = tl.load(k_norm_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, qw1, qw2, eps,
                  HAS_NORM, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_kv_heads, cos, sin, kw1, kw2, eps,
                  HAS_NORM, HALF, BLOCK_HK, BLOCK_HALF)


def rope_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             inv_freq: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
             k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """In place: q (T, Hq, D), k (T, Hkv, D) views (last dim contiguous) get
    [per-head RMSNorm if weights are given, then] RoPE at their positions (T,).
    inv_freq: (D/2,) fp32 on q's device (scaling already applied)."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and head_dim % 2 == 0
    has_norm = q_norm_weight is not None
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q, k, positions, inv_freq,
        q_norm_weight if has_norm else inv_freq, k_norm_weight if has_norm else inv_freq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), num_q_heads, k.shape[1], eps,
        HAS_NORM=has_norm, HALF=half, BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]), BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4)


def rope_qk_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  inv_freq: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                  k_norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (out of place), written as transformers computes it."""
    from .rmsnorm import rmsnorm_torch

    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)

    def rotate(x):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    if q_norm_weight is not None:
        q, k = rmsnorm_torch(q, q_norm_weight, eps), rmsnorm_torch(k, k_norm_weight, eps)
    return rotate(q), rotate(k)
