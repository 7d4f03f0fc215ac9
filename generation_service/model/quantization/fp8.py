"""FP8 (e4m3) numerics in plain torch: the reference every FP8 path is tested against.

Scales are dequantization multipliers (value = fp8 * scale), as every FP8 checkpoint format
stores them. A weight's scales form a grid over (N, K) in blocks of `block` = (rows, cols):
per-channel is (1, K), per-tensor (N, K), DeepSeek/Qwen block scales (128, 128).
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: e4m3fn has no inf, so overflow must be clamped
MIN_SCALE = 1e-12  # an all-zero row or token still divides by something


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3 (saturating: a value past 448 would become NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weight -> (N, K) fp8 and (N, 1) fp32 scales, one per output channel (row)."""
    scale = (weight.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8(weight, scale), scale


def quantize_per_token(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) activations -> fp8 and fp32 scales (M, 1) per token, or (M, K / group) per
    token and group of `group` columns (the activations of block-scaled weights)."""
    rows, cols = x.shape
    group = group or cols
    x32 = x.float().view(rows, cols // group, group)
    scale = (x32.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # (M, groups)
    return to_fp8(x32, scale[..., None]).view(rows, cols), scale


def expand_scales(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """A scale grid (ceil(N / rows), ceil(K / cols)) -> one scale per element (N, K)."""
    rows, cols = block
    full = scale.float().repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
    return full[: shape[0], : shape[1]]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 (N, K) with its scale grid -> fp32 (N, K)."""
    return weight.float() * expand_scales(scale, block, tuple(weight.shape))


def fake_quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None,
                              group: int | None) -> torch.Tensor:
    """x (.., K) rounded through fp8 as the GPU's GEMM inputs are, in fp32: by the static
    per-tensor `input_scale`, else dynamically per token (and per `group` columns if set)."""
    flat = x.reshape(-1, x.shape[-1])
    if input_scale is not None:
        out = to_fp8(flat, input_scale.float()).float() * input_scale.float()
    else:
        x8, scale = quantize_per_token(flat, group)
        group = group or flat.shape[1]
        out = (x8.float().view(flat.shape[0], -1, group) * scale[..., None]).view(flat.shape)
    return out.view(x.shape)
