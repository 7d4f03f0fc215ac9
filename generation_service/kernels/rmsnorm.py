"""RMSNorm with an optional residual add in front: one launch per norm, one program per token.

Numerics follow transformers' LlamaRMSNorm, which the model's reference uses, op by op in
the activation dtype: h = x + residual rounded (what an unfused bf16 add stores), normalise
h in fp32, round, multiply by the weight, round again. So results differ from the torch
reference only by the fp32 summation order inside the norm; the new residual is equal.

Without a weight (`weight=None`) the kernel stops at the rounded normalised rows: the fused
decode forward folds the norm weights into the next projection's weight at load.

Two entry points over the one kernel:
- `add_rmsnorm` (the fused decode forward): out of place, returns (out, residual + x), or
  (out, x) without a residual;
- `fused_add_rmsnorm`: residual <- x + residual in place, returns the norm.
One launch per norm replaces the residual add and the ~7 launches of the torch RMSNorm
(docs/gpu.md, "The decode forward").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait


@triton.jit
def _rmsnorm_kernel(x_ptr, residual_ptr, new_residual_ptr, weight_ptr, out_ptr,
                    stride_x, stride_r, stride_nr, stride_o, dim, eps,
                    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # before any global access (pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # the rounded bf16 add
        tl.store(new_residual_ptr + row * stride_nr + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / dim + eps)
    y = (x32 * inv_rms).to(x.dtype)  # cast back before the weight, as transformers does
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
        y = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, new_residual: torch.Tensor | None,
            weight: torch.Tensor | None, eps: float, out: torch.Tensor | None) -> torch.Tensor:
    """Rows of x (..., dim) (last dim contiguous); with a residual, x + residual goes to
    new_residual (which may be residual itself); without a weight, the bare normalised rows.
    Returns out shaped like x."""
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    out2 = torch.empty_like(x2) if out is None else out.view(-1, dim)
    r2 = residual.view(-1, dim) if residual is not None else x2
    nr2 = new_residual.view(-1, dim) if new_residual is not None else x2
    num_rows = x2.shape[0]
    if num_rows:
        block = triton.next_power_of_2(dim)
        # 8 warps at the 8B hidden size (4096): the setting the v2 decode graphs were timed with
        _rmsnorm_kernel[(num_rows,)](
            x2, r2, nr2, weight if weight is not None else x2, out2, x2.stride(0), r2.stride(0),
            nr2.stride(0), out2.stride(0), dim, eps, HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None, BLOCK=block,
            num_warps=8 if block >= 4096 else 4, **pdl_launch(x2))
    return out2.view(x.shape)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """residual <- x + residual (in place); returns rmsnorm(residual)."""
    assert residual.is_contiguous() and residual.shape == x.shape
    return _launch(x, residual, residual, weight, eps, out)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place: (rmsnorm(residual + x) * weight, residual + x); without a residual
    (rmsnorm(x) * weight, x). Neither input is written (graph bodies may read them again).
    weight None: the norm's weight is folded into the next GEMM's weight
    (decode_forward.fuse_layer_weights), so out = rmsnorm(...) rounded, not multiplied."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    if residual is None:
        return _launch(x, None, None, weight, eps, None), x
    new_residual = torch.empty_like(x)
    return _launch(x, residual, new_residual, weight, eps, None), new_residual


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32.to(x.dtype) if weight is None else weight * x32.to(x.dtype)


def fused_add_rmsnorm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> torch.Tensor:
    residual.copy_(x + residual)
    return rmsnorm_torch(residual, weight, eps)
