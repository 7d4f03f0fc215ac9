"""decode_fused.py (the engine's fused element-wise decode ops) vs plain torch."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
decode_fused = pytest.importorskip("generation_service.kernels.decode_fused")

from generation_service.kernels.rmsnorm import rmsnorm_torch  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rmsnorm(rel_err, dtype):
    x = torch.randn(5, 96).to(dtype)
    residual = torch.randn(5, 96).to(dtype)
    weight = (torch.rand(96) + 0.5).to(dtype)
    out, new_residual = decode_fused.add_rmsnorm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, x + residual)
    assert rel_err(out, rmsnorm_torch(x + residual, weight, 1e-5)) < 2e-3
    out, same = decode_fused.add_rmsnorm(x, None, weight, 1e-5)
    assert same is x and rel_err(out, rmsnorm_torch(x, weight, 1e-5)) < 2e-3


@pytest.mark.parametrize("block_h", [None, 1, 2, 4])  # a decode step's launch; a prefill's head blocks
def test_rope_write_kv(rel_err, block_h):
    """Every head of every token rotated, k and v in their slots, whatever heads a program
    takes (3 kv heads: a block of 2 or 4 has masked heads)."""
    tokens, hq, hkv, dim, page = 3, 6, 3, 32, 16
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim)
    positions = torch.tensor([5, 17, 40])
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.cat([positions.float()[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    k_cache = torch.randn(4, page, hkv, dim)
    v_cache = torch.randn_like(k_cache)
    slots = torch.tensor([16 + 5, 32 + 1, 48 + 8])
    k_want, v_want = k_cache.clone(), v_cache.clone()
    q = decode_fused.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, hq, hkv, dim, block_h=block_h,
                                   num_warps=None if block_h is None else max(1, block_h // 2))

    def rope(x):
        half = dim // 2
        return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]

    q_ref, k_ref, v_ref = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=1)
    assert rel_err(q, rope(q_ref.view(tokens, hq, dim))) < 1e-6
    k_want.view(-1, hkv, dim)[slots] = rope(k_ref.reshape(tokens, hkv, dim))
    v_want.view(-1, hkv, dim)[slots] = v_ref.reshape(tokens, hkv, dim)
    assert rel_err(k_cache, k_want) < 1e-6 and torch.equal(v_cache, v_want)


def test_silu_mul(rel_err):
    gate_up = torch.randn(3, 2 * 1500)
    gate, up = gate_up.chunk(2, dim=1)
    assert rel_err(decode_fused.silu_mul(gate_up), F.silu(gate) * up) < 1e-6
