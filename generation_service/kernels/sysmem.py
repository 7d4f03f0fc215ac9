"""System-scope memory operations for kernels that publish to the CPU (the step channel).

The step channel's sequence words live in mapped host memory that grammar_service reads on
the CPU: a kernel publishes a word only after its other stores are visible system-wide.
`fence_system` is __threadfence_system (`fence.sc.sys`) in every thread that holds an element;
`store_system` is a strong system-scope store (`st.relaxed.sys`, a volatile store; not an atomic:
the H200 hosts have no native atomics on mapped host memory,
CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED = 0). Both are inline PTX, which the
interpreter cannot run: kernels take a `SYS_FENCE` constexpr, `SYS_FENCE` below, and under the
interpreter (one program run in order, on the CPU) store plainly instead: `store_seq`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .pdl import _INTERPRETED

SYS_FENCE = not _INTERPRETED  # pass as the kernels' SYS_FENCE constexpr


@triton.jit
def fence_system(x):
    """__threadfence_system in every thread that holds an element of `x` (returned as an
    unused int32 tensor: inline asm must return something)."""
    return tl.inline_asm_elementwise("fence.sc.sys; mov.b32 $0, 0;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def store_system(ptrs, value, is_mine):
    """*ptrs = value, a strong system-scope (volatile) store, by the threads where is_mine != 0."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.relaxed.sys.global.b32 [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [ptrs, value, is_mine], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_seq(seq_ptr, n, lanes, SYS_FENCE: tl.constexpr):
    """*seq_ptr = n (a scalar), stored once, by the thread holding lane 0 of `lanes` (a tensor of
    the caller's block): `store_system` on the GPU, a plain store under the interpreter."""
    if SYS_FENCE:
        store_system(seq_ptr + lanes * 0, n + lanes * 0, (lanes == 0).to(tl.int32))
    else:
        tl.store(seq_ptr, n)
