"""The fused decode forward (engine/decode_forward.py) on a tiny fp32 Llama, in Triton's
interpreter: every way of running a step's layer loop gives the logits of the model's own
modules (the unfused loop), and the K/V it writes land where they belong.

Ways: cuBLAS GEMMs (F.linear), with the fused prologue or the torch ops it replaces, and Triton
GEMVs for every projection (`kernels/gemv.py`, which the H200 table picks per projection at
small buckets). The table is bf16-only, so the test makes
it send every projection to Triton. bf16 on the real shapes: tests/gpu/test_gemv.py.
"""
import dataclasses

import pytest
import torch

pytest.importorskip("triton")
gemv = pytest.importorskip("generation_service.kernels.gemv")

from generation_service.engine.cuda_graphs import DecodeBuffers  # noqa: E402
from generation_service.engine.decode_forward import DecodeForward  # noqa: E402
from generation_service.engine.kv_cache import KVCache  # noqa: E402
from generation_service.model.presets import PRESETS  # noqa: E402
from generation_service.model.random_init import build_random_model  # noqa: E402

PAGE, PAGES_PER_ROW, CONTEXT = 4, 4, 9


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(PRESETS["llama-3.2-1b"], num_layers=2, hidden_size=64,
                                 intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=32,
                                 vocab_size=80, tie_word_embeddings=False)
    model = build_random_model(config, torch.device("cpu"), torch.float32, seed=0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norm weights start at 1: make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
    return model


def forward(model, batch: int, *, gemv_max_batch: int, fused_ops: bool = True,
            fused_prologue: bool = True):
    """(logits, k cache, v cache) of one decode step of `batch` rows over the same random cache."""
    cfg = model.config
    kv = KVCache(cfg.num_layers, 1 + batch * PAGES_PER_ROW, PAGE, cfg.num_kv_heads, cfg.head_dim,
                 torch.float32, "cpu")
    gen = torch.Generator().manual_seed(1)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=gen))
    buffers = DecodeBuffers.allocate(batch, PAGES_PER_ROW, "cpu")
    table = torch.arange(1, 1 + batch * PAGES_PER_ROW, dtype=torch.int32).view(batch, PAGES_PER_ROW)
    positions = CONTEXT + torch.arange(batch)  # ragged rows
    buffers.set_rows(0, torch.randint(0, cfg.vocab_size, (batch,), generator=gen), positions,
                     (positions + 1).int(), table)
    step = DecodeForward(model, kv, buffers, fused_ops=fused_ops, gemv_max_batch=gemv_max_batch)
    step.fused_prologue = fused_prologue
    with torch.no_grad():
        return step(batch).float(), torch.stack(kv.k), torch.stack(kv.v)


def every_projection_triton(m, weight, *, fused=False):
    n = weight.shape[0] // (2 if fused else 1)
    cfg = gemv.candidate_configs(m, n, weight.shape[1], fused=fused)[0]
    return dataclasses.replace(cfg, block_n=min(cfg.block_n, 32), block_k=min(cfg.block_k, 32))


@pytest.mark.parametrize("batch", [1, 3])
def test_every_fused_form_gives_the_modules_logits(model, monkeypatch, rel_err, batch):
    ref, ref_k, ref_v = forward(model, batch, gemv_max_batch=0, fused_ops=False)
    cublas = forward(model, batch, gemv_max_batch=0)
    torch_prologue = forward(model, batch, gemv_max_batch=0, fused_prologue=False)
    monkeypatch.setattr(gemv, "measured_config", every_projection_triton)
    triton_gemv = forward(model, batch, gemv_max_batch=8)
    forms = {"cublas": cublas, "cublas, torch prologue": torch_prologue, "gemv": triton_gemv}
    for name, (logits, k, v) in forms.items():
        assert logits.shape == ref.shape, name
        assert rel_err(logits, ref) < 1e-5, name
        assert rel_err(k, ref_k) < 1e-5 and rel_err(v, ref_v) < 1e-5, name
