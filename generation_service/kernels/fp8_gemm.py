"""FP8 GEMMs for prefill and mixed steps: activations quantized to e4m3 per token (or by a
checkpoint's static scale) in one Triton launch, then torch._scaled_mm (cuBLASLt's FP8 tensor
cores, row-wise scales) with the weight's per-channel scales, output in the activations' dtype.

Numerics: y[m, n] = sum_k q(x)[m, k] w8[n, k] * sx[m] * sw[n] with fp32 accumulation, q the
e4m3 rounding of x / sx; `model/quantization/linear.py`'s reference computes the same in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from generation_service.model.quantization.weight import Fp8Weight

from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait

FP8_MAX = 448.0
MIN_SCALE = 1e-12
ALIGN = 16  # _scaled_mm needs K and N multiples of 16


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, static_ptr, K, stride_x, stride_o,
                          STATIC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per row: scale = amax(|x|) / 448 (STATIC: the given one), x / scale in e4m3."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # before any global access (pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
    inv = 1.0 / scale
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x * inv, -448.0, 448.0).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + k0 + offs, q, mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (e4m3 (M, K), fp32 scales (M, 1)): per row, or every row by `static_scale`
    (1,). Graph safe: one launch."""
    rows, cols = x.shape
    assert x.stride(1) == 1
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(4096, triton.next_power_of_2(cols))
        _quantize_rows_kernel[(rows,)](x, out, scale, static_scale if static_scale is not None else scale,
                                       cols, x.stride(0), out.stride(0), STATIC=static_scale is not None,
                                       BLOCK=block, num_warps=4, **pdl_launch(x))
    return out, scale


def can_scaled_mm(weight: Fp8Weight) -> bool:
    n, k = weight.shape
    return n % ALIGN == 0 and k % ALIGN == 0


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (.., K) in bf16/fp16 -> x @ dequantized(weight)^T + bias in x's dtype."""
    n, k = weight.shape
    flat = x.reshape(-1, k)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if not can_scaled_mm(weight):  # shapes cuBLASLt refuses: the dequantized weight
        out = torch.nn.functional.linear(flat, (weight.weight.to(x.dtype) * weight.scale[:, None].to(x.dtype)))
    else:
        x8, x_scale = quantize_rows(flat, None if weight.dynamic else weight.input_scale)
        out = torch._scaled_mm(x8, weight.weight.t(), scale_a=x_scale, scale_b=weight.scale.view(1, n),
                               out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n)
