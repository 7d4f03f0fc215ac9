"""The fused decode forward's element-wise ops (`engine/decode_forward.py`): ~10 launches per layer.

A decode layer of torch ops around the GEMMs and the attention kernels launches ~36 kernels
and is launch bound at any model size (8B B=1 on an H200: 6.19 ms unfused against 4.23 ms fused;
docs/gpu.md, "The decode forward"). Three kernels cut a layer to ~10 launches:

- `add_rmsnorm` (rmsnorm.py): residual += delta, then RMSNorm of the new residual (one launch
  per norm, replaces the residual add and the ~7 launches of the torch RMSNorm);
- `rope_write_kv` (rotary.py): RoPE of q and k straight out of the fused qkv projection,
  rotated k and v stored into the paged cache at the step's slots (replaces ~12 launches);
- `silu_mul` (here): silu(gate) * up out of the fused gate_up projection.

Rounding follows the torch reference op by op (bf16 after every torch op), so results differ
from the unfused path only by fp32 summation order inside the norm and, compiled for the
GPU, in the last bf16 bit of about a fifth of the RoPE outputs (products kept in fp32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from .rmsnorm import add_rmsnorm
from .rotary import rope_write_kv

__all__ = ["add_rmsnorm", "rope_write_kv", "silu_mul"]


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # before any global access (pdl.py)
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
    _silu_mul_kernel[(rows, triton.cdiv(n_cols, block))](gate_up, out, n_cols, BLOCK=block, num_warps=4,
                                                         **pdl_launch(gate_up))
    return out
