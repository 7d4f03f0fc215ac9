"""GPU kernels (Triton) and their torch references.

Kernel modules import triton; nothing here does until a triton backend is asked for.
Rooms: decode_attention, extend_attention, kv_write (paged attention and its cache
writes), prepare_inputs (fused decode input preparation), mask_sample + philox
(grammar mask + sampling; sample_reference is its torch twin), rmsnorm (RMSNorm with an
optional residual add), rotary (RoPE; with the K/V cache write for the decode forward),
decode_fused (the decode forward's element-wise set: those two plus silu*mul),
decode_prologue (embedding, cos/sin and cache slots before the first layer; it can publish
the step channel's inputs_seq), step_epilogue (the bookkeeping after sampling, outputs_seq),
mask_gather (the step's masks from the mapped ring), sysmem (their system-scope fence and
store), stamp (GPU timestamps around a step's mask wait: diagnostics), gemv
(skinny GEMMs for decode buckets <= 8 and the measured Triton/cuBLAS choice per projection),
pdl (programmatic dependent launch: the decode forward's kernels overlap their launches),
fp8_gemm (FP8 projections: activations quantized per token, torch._scaled_mm).
NOTES.md: floors and measurements.
"""
from __future__ import annotations

from .attention_backend import AttentionBackend, AttentionMetadata

_ATTENTION_BACKENDS = {"torch": "TorchAttentionBackend", "triton": "TritonAttentionBackend"}


def get_attention_backend(name: str = "triton") -> AttentionBackend:
    """The attention backend registered under ``name`` ("torch" or "triton")."""
    if name not in _ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; "
                         f"choose from {sorted(_ATTENTION_BACKENDS)}")
    from . import attention_backend
    return getattr(attention_backend, _ATTENTION_BACKENDS[name])()


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
