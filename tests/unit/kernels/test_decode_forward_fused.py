"""The fused decode forward (engine/decode_forward.py) on a tiny fp32 Llama, in Triton's
interpreter: every way of running a step's layer loop gives the logits of the model's own
modules (the unfused loop), and the K/V it writes land where they belong.

Ways: cuBLAS GEMMs (F.linear), with the fused prologue or the torch ops it replaces, and Triton
GEMVs for every projection (`kernels/gemv.py`, which the H200 table picks per projection at
small buckets), with the RMSNorms folded into the GEMVs around them or not. The table is
bf16-only, so the tests make it send the projections they name to Triton. bf16 on the real
shapes: tests/gpu/test_gemv.py and test_norm_fold.py.
"""
import dataclasses
from collections import Counter

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
            fused_prologue: bool = True, fold_norms: bool = True, plan: dict | None = None):
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
    step.fold_norms = fold_norms
    if plan is not None:  # what the step will run at this bucket
        plan.update(step.gemv_plan(batch))
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


def projection_of(model, weight, fused):
    """The tiny model's projection names by weight shape (all distinct)."""
    cfg = model.config
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {(q_dim + 2 * kv_dim, cfg.hidden_size): "qkv", (cfg.hidden_size, q_dim): "o_proj",
              (2 * cfg.intermediate_size, cfg.hidden_size): "gate_up_silu",
              (cfg.hidden_size, cfg.intermediate_size): "down",
              (cfg.vocab_size, cfg.hidden_size): "lm_head"}
    name = shapes[tuple(weight.shape)]
    assert fused == (name == "gate_up_silu")
    return name


def triton_for(model, names):
    """A stand-in for gemv.measured_config: Triton for the projections `names`, cuBLAS else."""
    def config(m, weight, *, fused=False, pdl=None):
        if projection_of(model, weight, fused) in names:
            return every_projection_triton(m, weight, fused=fused)
        return gemv.CUBLAS
    return config


ALL = {"qkv", "o_proj", "gate_up_silu", "down", "lm_head"}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("on_triton,folded", [
    (ALL, {"input_norm", "post_attention_norm"}),  # at one row on the 8B and 1B shapes
    ({"o_proj", "gate_up_silu", "lm_head"}, {"post_attention_norm"}),  # 8B at 2..8 rows
    ({"qkv", "down"}, {"input_norm"}),
    ({"gate_up_silu", "lm_head"}, set()),  # 1B at 2..8 rows: nothing folds
    ({"o_proj", "down"}, set()),  # producers only
    ({"qkv", "gate_up_silu"}, set()),  # consumers only
])
def test_norms_fold_where_both_gemms_run_triton(model, monkeypatch, rel_err, batch, on_triton,
                                                folded):
    """A norm folds into the GEMMs around it where both run Triton: the step then launches one
    add_rmsnorm fewer per folded norm and layer (layer 0's input norm and the final norm stay),
    all but the final norm without a weight (the weights carry them), and gives the logits of
    the model's own modules, as does the same step with fold_norms off."""
    from generation_service.kernels import decode_fused
    ref, ref_k, ref_v = forward(model, batch, gemv_max_batch=0, fused_ops=False)
    monkeypatch.setattr(gemv, "measured_config", triton_for(model, on_triton))
    norms = Counter()
    add_rmsnorm = decode_fused.add_rmsnorm
    monkeypatch.setattr(decode_fused, "add_rmsnorm", lambda x, residual, weight, eps: norms.update(
        [weight is None]) or add_rmsnorm(x, residual, weight, eps))
    num_layers = model.config.num_layers
    for fold_norms in (True, False):
        norms.clear()
        plan = {}
        logits, k, v = forward(model, batch, gemv_max_batch=8, fold_norms=fold_norms, plan=plan)
        want = folded if fold_norms else set()
        assert {name for name, v in plan.items() if v == "folded"} == want, plan
        assert {name for name, v in plan.items() if v not in ("cublas", "folded", "kernel")} == on_triton
        # per layer: input norm and post-attention norm, less what folds (never layer 0's
        # input norm); weightless but the final norm
        weightless = 2 * num_layers - len(want) * num_layers + ("input_norm" in want)
        assert norms == {True: weightless, False: 1}, (fold_norms, norms)
        assert rel_err(logits, ref) < 1e-5, fold_norms
        assert rel_err(k, ref_k) < 1e-5 and rel_err(v, ref_v) < 1e-5, fold_norms


def test_folding_copies_never_touch_the_model(model):
    """The fused weights carry the norm weights (W * g, rounded once); the model's own
    parameters, which its modules and prefill use, and the torch path's weights stay as they
    were."""
    before = {name: p.clone() for name, p in model.named_parameters()}
    cfg = model.config
    kv = KVCache(cfg.num_layers, 2, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    buffers = DecodeBuffers.allocate(1, PAGES_PER_ROW, "cpu")
    fused, plain = (DecodeForward(model, kv, buffers, fused_ops=ops) for ops in (True, False))
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    for index, layer in enumerate(model.model.layers):
        a, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        assert fused.weights[index].norms_folded and not plain.weights[index].norms_folded
        assert torch.equal(fused.weights[index].qkv, qkv * layer.input_layernorm.weight)
        assert torch.equal(fused.weights[index].gate_up, gate_up * layer.post_attention_layernorm.weight)
        assert torch.equal(plain.weights[index].qkv, qkv)
        assert torch.equal(plain.weights[index].gate_up, gate_up)
