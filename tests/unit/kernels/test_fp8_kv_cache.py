"""FP8 KV pages (e4m3, one scale per layer for K and one for V): the kernels write them as the
torch writers do and read them as the torch references do (interpreter; compiled on the GPU in
tests/gpu/test_fp8.py)."""
import pytest
import torch

pytest.importorskip("triton")

from generation_service.engine.kv_cache import KV_FP8, from_cache, to_cache  # noqa: E402
from generation_service.kernels.decode_attention import decode_attention, decode_attention_torch  # noqa: E402
from generation_service.kernels.extend_attention import extend_attention, extend_attention_torch  # noqa: E402
from generation_service.kernels.kv_write import write_kv, write_kv_torch  # noqa: E402
from generation_service.kernels.rotary import rope_write_kv  # noqa: E402
from generation_service.model.layers import apply_rope  # noqa: E402

K_SCALE, V_SCALE = 0.02, 0.05  # neither is 1: a missing multiply or divide shows
SEQ_LENS = [1, 15, 17, 0, 70]


def fp8_paged(make_paged, seq_lens):
    """A random cache in fp32 and the same values in FP8 pages; the fp32 one holds what the
    FP8 pages mean (so the kernels' only error is their arithmetic)."""
    k, v, page_table, lens = make_paged(seq_lens)
    k8, v8 = to_cache(k, KV_FP8, K_SCALE), to_cache(v, KV_FP8, V_SCALE)
    return k8, v8, from_cache(k8, torch.float64, K_SCALE), from_cache(v8, torch.float64, V_SCALE), page_table, lens


def test_writes_scale_saturate_and_match_the_torch_writer(same_fp8):
    k_cache = torch.zeros(4, 16, 2, 32, dtype=KV_FP8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, 40, 63])
    k, v = torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    k[0, 0, 0] = 1e4  # past 448 * scale: saturates, never NaN
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_torch(k, v, want_k, want_v, slots, K_SCALE, V_SCALE)
    write_kv(k, v, k_cache, v_cache, slots, K_SCALE, V_SCALE)
    same_fp8(k_cache, want_k)
    same_fp8(v_cache, want_v)
    stored = from_cache(want_k, torch.float32, K_SCALE).view(-1, 2, 32)[slots]
    assert stored[0, 0, 0] == 448 * K_SCALE and torch.isfinite(stored).all()
    assert torch.allclose(stored[1:], k[1:], rtol=2 ** -4, atol=2 ** -9 * K_SCALE)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_reads_fp8_pages(make_paged, rel_err, num_splits):
    k8, v8, k, v, page_table, lens = fp8_paged(make_paged, SEQ_LENS)
    q = torch.randn(len(SEQ_LENS), 8, 32).half()
    out = decode_attention(q, k8, v8, page_table, lens, 0.17, num_splits=num_splits, block_n=16,
                           k_scale=K_SCALE, v_scale=V_SCALE)
    ref = decode_attention_torch(q.double(), k, v, page_table, lens, 0.17, compute_dtype=torch.float64)
    torch_fp8 = decode_attention_torch(q.double(), k8, v8, page_table, lens, 0.17, compute_dtype=torch.float64,
                                       k_scale=K_SCALE, v_scale=V_SCALE)
    assert rel_err(out, ref) < 2e-3 and rel_err(torch_fp8, ref) < 1e-12


def test_extend_reads_fp8_pages(make_paged, rel_err):
    rows = [(20, 20), (37, 5), (0, 0), (50, 4)]
    k8, v8, k, v, page_table, lens = fp8_paged(make_paged, [s for s, _ in rows])
    extend_lens = torch.tensor([e for _, e in rows], dtype=torch.int32)
    q = torch.randn(int(extend_lens.sum()), 4, 32).half()
    out = extend_attention(q, k8, v8, page_table, lens, extend_lens, 0.2, max_extend_len=20, block_n=16,
                           k_scale=K_SCALE, v_scale=V_SCALE)
    ref = extend_attention_torch(q.double(), k, v, page_table, lens, extend_lens, 0.2,
                                 compute_dtype=torch.float64)
    torch_fp8 = extend_attention_torch(q.double(), k8, v8, page_table, lens, extend_lens, 0.2,
                                       compute_dtype=torch.float64, k_scale=K_SCALE, v_scale=V_SCALE)
    assert rel_err(out, ref) < 2e-3 and rel_err(torch_fp8, ref) < 1e-12


def test_rope_write_kv_stores_fp8_as_the_torch_writer(same_fp8):
    heads, kv_heads, dim, tokens = 4, 2, 32, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).half()
    angles = torch.randn(tokens, dim // 2).repeat(1, 2)
    cos, sin = angles.cos().half(), angles.sin().half()
    k_cache = torch.zeros(2, 16, kv_heads, dim, dtype=KV_FP8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([16, 5, 30])
    rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, dim, k_scale=K_SCALE, v_scale=V_SCALE)
    q_dim, kv_dim = heads * dim, kv_heads * dim
    k = apply_rope(qkv[:, q_dim:q_dim + kv_dim].view(tokens, kv_heads, dim), cos, sin)
    v = qkv[:, q_dim + kv_dim:].view(tokens, kv_heads, dim)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim)[slots], v_cache.view(-1, kv_heads, dim)[slots]
    same_fp8(flat_k, to_cache(k, KV_FP8, K_SCALE))
    same_fp8(flat_v, to_cache(v, KV_FP8, V_SCALE))
