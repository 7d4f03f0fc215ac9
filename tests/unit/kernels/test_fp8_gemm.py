"""FP8 projections' kernels against the fp32 references of model/quantization (interpreter;
tests/gpu/test_fp8.py runs them compiled, with torch._scaled_mm)."""
import pytest
import torch

pytest.importorskip("triton")

from generation_service.kernels import gemv  # noqa: E402
from generation_service.kernels.fp8_gemm import quantize_rows  # noqa: E402
from generation_service.model.quantization.fp8 import (  # noqa: E402
    FP8_DTYPE, dequantize, quantize_per_channel, quantize_per_token, to_fp8)
from generation_service.model.quantization.weight import Fp8Weight  # noqa: E402


def fp8_weight(n, k, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w8, scale = quantize_per_channel(w)
    return Fp8Weight(w8, scale.view(-1)), dequantize(w8, scale, (1, k))


def test_quantize_rows_matches_per_token_reference(same_fp8):
    x = torch.randn(5, 96) * torch.tensor([1, 10, 0.01, 300, 1.0])[:, None]
    x[4] = 0  # an all-zero row still gets a finite scale
    x8, scale = quantize_rows(x.half())
    want8, want_scale = quantize_per_token(x.half())
    assert x8.dtype == FP8_DTYPE and scale.shape == (5, 1)
    assert torch.allclose(scale, want_scale, rtol=1e-6)
    same_fp8(x8, want8)
    assert torch.equal(x8[4].float(), torch.zeros(96))


def test_quantize_rows_by_a_static_scale(same_fp8):
    x = torch.randn(3, 64).half() * 4
    static = torch.tensor([0.02])
    x8, scale = quantize_rows(x, static)
    assert torch.equal(scale, static.expand(3, 1))
    same_fp8(x8, to_fp8(x, static))


@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_gemv_matches_the_dequantized_weight(rel_err, rows):
    weight, dense = fp8_weight(48, 256)
    x = torch.randn(rows, 256).half()
    bias = torch.randn(48).half()
    out = gemv.linear(x, weight, bias)
    ref = x.double() @ dense.double().T + bias.double()
    assert out.dtype == torch.float16 and rel_err(out, ref) < 2e-3


@pytest.mark.parametrize("rows", [1, 2])
def test_fp8_gate_up_silu_scales_gate_and_up_rows_apart(rel_err, rows):
    gate, gate_dense = fp8_weight(32, 128, seed=1)
    up, up_dense = fp8_weight(32, 128, seed=2)
    up = Fp8Weight(up.weight, up.scale * 7)  # the up rows' scales must not be the gate rows'
    gate_up = Fp8Weight.cat([gate, up])
    x = torch.randn(rows, 128).half()
    out = gemv.gate_up_silu(x, gate_up)
    g, u = x.double() @ gate_dense.double().T, x.double() @ (7 * up_dense.double()).T
    assert rel_err(out, torch.nn.functional.silu(g) * u) < 3e-3
