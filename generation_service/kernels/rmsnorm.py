"""RMSNorm and residual-add + RMSNorm, one launch each, one program per token.

Numerics follow transformers' LlamaRMSNorm, which the model's reference uses: normalise
in fp32, round to the activation dtype, then multiply by the weight (rounded again).
The fused variant first forms h = x + residual rounded to the activation dtype (what an
unfused bf16 add stores), writes h back into ``residual`` and normalises that h:
    residual <- x + residual;  out <- rmsnorm(residual)
which saves a read and a write of the hidden state and a launch per norm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o,
                    dim, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / dim + eps)
    y = (x32 * inv_rms).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def _launch(x, residual, weight, eps, out):
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    out = torch.empty_like(x2) if out is None else out.view(-1, dim)
    r2 = residual.view(-1, dim) if residual is not None else x2
    num_rows = x2.shape[0]
    if num_rows:
        block = triton.next_power_of_2(dim)
        _rmsnorm_kernel[(num_rows,)](
            x2, r2, weight, out, x2.stride(0), r2.stride(0), out.stride(0), dim, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., dim) -> weight * normalised x, in x's dtype."""
    return _launch(x, None, weight, eps, out)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """residual <- x + residual (in place); returns rmsnorm(residual)."""
    assert residual.is_contiguous() and residual.shape == x.shape
    return _launch(x, residual, weight, eps, out)


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rmsnorm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> torch.Tensor:
    residual.copy_(x + residual)
    return rmsnorm_torch(residual, weight, eps)
