"""Programmatic dependent launch (PDL, Hopper and later) for the decode forward's kernels.

A decode step at small batch is a chain of ~250 short kernels; between two of them the GPU
drains one grid and launches the next. With PDL a kernel starts while its predecessor still
runs: each kernel here calls `pdl_wait` before its first global load or store (it returns once
the predecessor has completed and its writes are visible) and `pdl_launch_dependents` once its
successor may be let in (the successor launches when every program of this kernel has called
it or exited). The small kernels (RMSNorm, RoPE, silu*mul, the attention reduce) call it at
their start; the GEMVs and the attention split kernel after their main loop, so the waiting
successor does not hold SM slots while they still stream (at their start the step ran slower on
an H200: docs/gpu.md, "The decode forward"). So the successor's launch and
setup overlap the predecessor's tail, and nothing is read or written early.

Rules for a kernel that takes `PDL`: `pdl_wait` unconditionally at its top, before any global
memory access and before any early exit (a kernel that exits without waiting would let the
next one run ahead of the grid before it). Launch with `**pdl_launch(tensor)`.
Off under the interpreter and before sm_90; `STRUCTGEN_PDL=0` turns it off (debugging, A/B).
CUDA graphs keep the launch attribute as a programmatic edge.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("STRUCTGEN_PDL", "1") != "0"  # module switch, read per launch
# Like @triton.jit, which picks interpreter or compiler once, when it decorates.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_on(tensor: torch.Tensor) -> bool:
    """Kernels working on `tensor` launch with PDL: ENABLED and the device supports it."""
    return (ENABLED and tensor.is_cuda and not _INTERPRETED
            and _supported(tensor.device.index if tensor.device.index is not None
                           else torch.cuda.current_device()))


def pdl_launch(tensor: torch.Tensor) -> dict:
    """Launch keywords for a kernel taking `PDL`: PDL and launch_pdl both `pdl_on(tensor)`."""
    on = pdl_on(tensor)
    return {"PDL": on, "launch_pdl": on}
