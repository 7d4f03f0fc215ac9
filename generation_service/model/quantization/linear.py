"""Fp8Linear: nn.Linear's place in the model for a layer whose weight is FP8 e4m3.

Parameters as the checkpoint names them (`weight` fp8 (N, K), `weight_scale` fp32,
`input_scale` for static activations, `bias` in the model's dtype), so a checkpoint's state
dict loads as is. After loading, `finish_loading` turns a per-tensor scale into per-channel
(N, 1) ones (exact), so every path but block scales sees one form.

Compute: on a CUDA device with per-channel scales, `kernels/fp8_gemm.py` (activations
quantized per token or by the static scale, torch._scaled_mm); everywhere else the reference
in fp32: the activations rounded through fp8 as that GEMM rounds them, the weight dequantized.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from generation_service.model.quantization.fp8 import (
    FP8_DTYPE, dequantize, fake_quantize_activations, quantize_per_channel)
from generation_service.model.quantization.scheme import Fp8Scheme
from generation_service.model.quantization.weight import Fp8Weight


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class Fp8Linear(nn.Module):
    """y = x @ dequantize(weight)^T + bias, x rounded through fp8 unless activation "none"."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Fp8Scheme) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.activation = scheme.activation
        self.group = scheme.activation_group  # columns per dynamic activation scale; None: the row
        self.block = {"tensor": (out_features, in_features), "channel": (1, in_features)}.get(
            scheme.weight_strategy, scheme.block)
        rows, cols = -(-out_features // self.block[0]), -(-in_features // self.block[1])
        scale_shape = (1,) if scheme.weight_strategy == "tensor" else (rows, cols)
        self.weight = _frozen(torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        self.weight_scale = _frozen(torch.empty(scale_shape, dtype=torch.float32))
        self.input_scale = _frozen(torch.empty(1)) if scheme.activation == "static" else None
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @property
    def is_per_channel(self) -> bool:
        return self.block == (1, self.in_features)

    @property
    def runs_fp8_kernels(self) -> bool:
        """Whether the GPU's FP8 GEMMs take this layer (per-channel scales, activations per
        token or tensor); else the reference computes it."""
        return self.is_per_channel and self.group is None

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Per-tensor scale -> per-channel (the same number on every row); scales 2-D."""
        if self.block == (self.out_features, self.in_features) and self.out_features > 1:
            self.weight_scale = _frozen(self.weight_scale.reshape(1, 1).expand(self.out_features, 1).contiguous())
            self.block = (1, self.in_features)
        else:
            self.weight_scale = _frozen(self.weight_scale.reshape(
                -(-self.out_features // self.block[0]), -(-self.in_features // self.block[1])))
        if self.input_scale is not None:
            self.input_scale = _frozen(self.input_scale.reshape(1).float())

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, scheme: Fp8Scheme) -> "Fp8Linear":
        """Online quantization: per-channel e4m3 weights, scale = the row's amax / 448."""
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, scheme)
        weight, scale = quantize_per_channel(linear.weight)
        out.weight, out.weight_scale = _frozen(weight), _frozen(scale)
        out.bias = linear.bias
        return out

    def fp8_weight(self) -> Fp8Weight:
        """The GEMM kernels' view (per-channel scales only)."""
        assert self.is_per_channel, "block-scaled weights run the reference path"
        return Fp8Weight(self.weight, self.weight_scale.view(-1), self.input_scale,
                         dynamic=self.activation != "static")

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.block).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.runs_fp8_kernels:
            from generation_service.kernels.fp8_gemm import fp8_linear
            return fp8_linear(x, self.fp8_weight(), self.bias)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 reference: what the GPU GEMM computes, up to its summation order."""
        x32 = x.float()
        if self.activation != "none":
            x32 = fake_quantize_activations(x32, self.input_scale, self.group)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x32, self.dequantized_weight(), bias).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={self.block}, activation={self.activation}")
