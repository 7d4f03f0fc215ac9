"""The attention backend registry and the two backends agreeing through it."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from generation_service.kernels import AttentionBackend, get_attention_backend  # noqa: E402


def test_registry_names():
    assert get_attention_backend("torch").name == "torch"
    assert isinstance(get_attention_backend("triton"), AttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")


def test_backends_agree_on_decode_extend_and_kv_write(make_paged, rel_err):
    torch_backend, triton_backend = get_attention_backend("torch"), get_attention_backend()
    k_cache, v_cache, page_table, seq_lens = make_paged([21, 40])
    extend_lens = torch.tensor([3, 1], dtype=torch.int32)
    batch = SimpleNamespace(page_table=page_table, seq_lens=seq_lens, extend_lens=extend_lens)
    k_new = torch.randn(4, 2, 32)
    slots = torch.tensor([page_table[0, 1] * 16 + 2, page_table[0, 1] * 16 + 3,
                          page_table[0, 1] * 16 + 4, page_table[1, 2] * 16 + 7]).long()
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    for backend, (kc, vc) in zip((torch_backend, triton_backend), caches):
        backend.write_kv(k_new, k_new, kc, vc, slots)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    kc, vc = caches[1]
    q = torch.randn(4, 8, 32)
    want = torch_backend.extend(q, kc, vc, batch, 0.2)
    got = triton_backend.extend(q, kc, vc, batch, 0.2, max_extend_len=3)
    assert rel_err(got, want) < 1e-5
    qd = torch.randn(2, 8, 32)
    assert rel_err(triton_backend.decode(qd, kc, vc, batch, 0.2),
                   torch_backend.decode(qd, kc, vc, batch, 0.2)) < 1e-5
