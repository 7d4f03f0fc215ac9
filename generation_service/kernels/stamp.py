"""A GPU timestamp into a per-step ring (diagnostics: where a captured step's time goes).

    stamps[N % R, which] = %globaltimer (ns)     N: the device step counter

`GpuDecodeRunner.wait_stamps` puts one before and one after the mask wait of a channel step, so
the host can read, step by step, how long the GPU really waited for grammar_service (the
benchmark's wait % is only a difference of means). Inline PTX: GPU only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stamp_kernel(stamps_ptr, step_ptr, num_slots, WHICH: tl.constexpr):
    zero = tl.zeros([1], dtype=tl.int32)
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [zero], dtype=tl.int64,
                                    is_pure=False, pack=1)
    n = tl.load(step_ptr).to(tl.int64)
    tl.store(stamps_ptr + (n % num_slots) * 2 + WHICH + tl.arange(0, 1), now)


def stamp(stamps: torch.Tensor, step: torch.Tensor, which: int) -> None:
    """stamps (R, 2) int64 on the device, step (1,) int32 the device step counter; which 0 or 1.
    Graph safe: one launch of one program."""
    assert stamps.dtype == torch.int64 and stamps.is_contiguous() and stamps.shape[1] == 2
    assert step.dtype == torch.int32 and which in (0, 1)
    _stamp_kernel[(1,)](stamps, step, stamps.shape[0], WHICH=which, num_warps=1)
