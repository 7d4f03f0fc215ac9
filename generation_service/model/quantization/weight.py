"""Fp8Weight: an FP8 projection as the GEMM kernels take it, in place of a weight tensor."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Weight:
    """weight (N, K) e4m3 row-major (nn.Linear's layout) with one fp32 scale per output
    channel; activations quantized per token (dynamic) or by `input_scale` (static)."""

    weight: torch.Tensor  # (N, K) float8_e4m3fn
    scale: torch.Tensor  # (N,) float32, value = fp8 * scale
    input_scale: torch.Tensor | None = None  # (1,) float32, static activations
    dynamic: bool = True

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @staticmethod
    def cat(parts: list["Fp8Weight"]) -> "Fp8Weight":
        """Projections of one input stacked along N (q/k/v, gate/up). Static activations need
        one input scale: the largest, so no part's input saturates (an extra rounding for the
        others, where their own scales were smaller)."""
        statics = [p.input_scale for p in parts if p.input_scale is not None]
        input_scale = torch.stack(statics).amax(0) if statics and len(statics) == len(parts) else None
        return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]),
                         input_scale, dynamic=input_scale is None)
