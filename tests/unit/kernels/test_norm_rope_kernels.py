"""RMSNorm, residual-add + RMSNorm (in place) and RoPE in place vs the torch references."""
import pytest
import torch

pytest.importorskip("triton")

from generation_service.kernels.rmsnorm import (  # noqa: E402
    add_rmsnorm, fused_add_rmsnorm, fused_add_rmsnorm_torch, rmsnorm_torch)
from generation_service.kernels.rotary import rope_qk_, rope_qk_torch  # noqa: E402


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_rmsnorm_and_fused_add(rel_err, dtype, tol):
    x = torch.randn(5, 96).to(dtype)  # dim not a power of 2: masked tail
    weight = (torch.rand(96) + 0.5).to(dtype)
    out, same = add_rmsnorm(x, None, weight, 1e-5)
    assert same is x and rel_err(out, rmsnorm_torch(x, weight, 1e-5)) < tol

    residual = torch.randn(5, 96).to(dtype)
    want_residual = residual.clone()
    want = fused_add_rmsnorm_torch(x, want_residual, weight, 1e-5)
    got = fused_add_rmsnorm(x, residual, weight, 1e-5)
    assert torch.equal(residual, want_residual)  # the add rounds exactly as torch's
    assert rel_err(got, want) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_weightless_add_rmsnorm(rel_err, dtype, tol):
    """weight None (the weight folded into the next GEMM): the normalised rows, unscaled, and
    the same new residual as with a weight."""
    x, residual = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    out, new_residual = add_rmsnorm(x, residual, None, 1e-5)
    assert torch.equal(new_residual, x + residual)
    x32 = new_residual.float()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert rel_err(out, want) < tol and rel_err(out, rmsnorm_torch(new_residual, None, 1e-5)) < tol
    weight = (torch.rand(96) + 0.5).to(dtype)  # with a weight: that weight times the same rows
    assert rel_err(add_rmsnorm(x, residual, weight, 1e-5)[0], weight * out) < tol


def _inv_freq(head_dim, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 0.0)])
def test_rope_in_place(rel_err, dtype, tol):
    """Op by op as the reference rounds: equal in fp16 (bit for bit), fp32 up to fma."""
    tokens, head_dim = 6, 32
    q = torch.randn(tokens, 4, head_dim).to(dtype)
    k = torch.randn(tokens, 2, head_dim).to(dtype)
    positions = torch.tensor([0, 1, 17, 900, 4095, 70000])
    inv_freq = _inv_freq(head_dim)
    want_q, want_k = rope_qk_torch(q, k, positions, inv_freq)
    rope_qk_(q, k, positions, inv_freq)
    assert rel_err(q, want_q) <= tol and rel_err(k, want_k) <= tol


def test_rope_strided_views_and_head_dim_not_a_power_of_two(rel_err):
    """q and k as views of one projection (row stride > heads * D), D = 96 (masked halves)."""
    tokens, hq, hkv, dim = 3, 2, 1, 96
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim)
    q = qkv[:, :hq * dim].unflatten(1, (hq, dim))
    k = qkv[:, hq * dim:(hq + hkv) * dim].unflatten(1, (hkv, dim))
    v_before = qkv[:, (hq + hkv) * dim:].clone()
    positions = torch.tensor([2, 50, 3000])
    inv_freq = _inv_freq(dim)
    want_q, want_k = rope_qk_torch(q, k, positions, inv_freq)
    rope_qk_(q, k, positions, inv_freq)
    assert rel_err(q, want_q) < 1e-6 and rel_err(k, want_k) < 1e-6
    assert torch.equal(qkv[:, (hq + hkv) * dim:], v_before)


def test_rope_matches_the_model_layers():
    layers = pytest.importorskip("generation_service.model.layers")
    q = torch.randn(4, 4, 64)
    k = torch.randn(4, 2, 64)
    positions = torch.tensor([3, 10, 100, 1000])
    inv_freq = layers.rope_inv_freq(64, 500000.0, None)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    want_q = layers.apply_rope(q, angles.cos(), angles.sin())
    want_k = layers.apply_rope(k, angles.cos(), angles.sin())
    rope_qk_(q, k, positions, inv_freq)
    assert torch.allclose(q, want_q, atol=1e-5) and torch.allclose(k, want_k, atol=1e-5)
