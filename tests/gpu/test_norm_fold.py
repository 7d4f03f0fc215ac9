"""The RMSNorm folded into the GEMVs around it (kernels/gemv.py, "Folded RMSNorm") on the GPU:
the producer and consumer kernels in bf16 on the 8B/1B shapes vs torch, and the decode forward
with fold_norms on and off vs the model's own forward (norm weights far from 1: random init sets
them to 1, where a fold that forgot the weight would still pass)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_helpers import load_rows, make_kv, small_config
from generation_service.engine.gpu_runner import GpuDecodeRunner

pytestmark = pytest.mark.gpu
CONTEXT = 40
PAGES_PER_ROW = 8
EPS = 1e-5
# (N, K): 8B o_proj, down; 1B o_proj, down; an uneven tail
PRODUCERS = [(4096, 4096), (4096, 14336), (2048, 2048), (2048, 8192), (1000, 1000)]
# (output columns, K, fused): 8B qkv, gate_up (I columns); 1B qkv, gate_up; uneven tails
CONSUMERS = [(6144, 4096, False), (14336, 4096, True), (3072, 2048, False), (8192, 2048, True),
             (1000, 1000, False), (1000, 1000, True)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def configs(m: int, n: int, k: int, fused: bool) -> list:
    """Every candidate config and the table's picks at m rows (MEASURED, PDL_M1)."""
    from generation_service.kernels.gemv import candidate_configs, measured_config
    weight = torch.empty((2 if fused else 1) * n, k, dtype=torch.bfloat16, device="meta")
    picks = [measured_config(m, weight, fused=fused, pdl=pdl) for pdl in (False, True)]
    return list(dict.fromkeys(candidate_configs(m, n, k, fused=fused) + [c for c in picks if c]))


def rows_of_scales(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 rows of RMS 1/4 .. 4: a norm applied to the wrong row shows."""
    scale = 2.0 ** torch.linspace(-2, 2, m, device="cuda")[:, None]
    return (torch.randn(m, k, device="cuda", generator=gen) * scale).bfloat16()


@pytest.mark.parametrize("n,k", PRODUCERS)
def test_add_residual_bf16(n, k):
    """h = the GEMM's bf16 output + residual, rounded: bit-equal to the plain GEMV plus the
    residual in torch; the residual untouched; per program the fp32 sums of h^2."""
    from generation_service.kernels.gemv import gemv, gemv_add_residual
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen).div_(k ** 0.5).bfloat16()
    for m in (1, 3, 8):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        residual = rows_of_scales(m, n, gen)
        kept = residual.clone()
        for cfg in configs(m, n, k, fused=False):
            h, rms = gemv_add_residual(x, w, None, residual, EPS, config=cfg)
            assert torch.equal(residual, kept), (m, str(cfg))
            assert torch.equal(h, gemv(x, w, config=cfg) + residual), (m, str(cfg))
            want = torch.stack([c.sum(1) for c in h.float().pow(2).split(cfg.block_n, dim=1)], dim=1)
            assert rms.sum_sq.shape == want.shape and rel_err(rms.sum_sq, want) < 1e-5, (m, str(cfg))


@pytest.mark.parametrize("n,k,fused", CONSUMERS)
def test_rms_scale_bf16(n, k, fused):
    """x raw with its RowRms and the norm weight folded into W: within bf16 rounding of the
    float64 rmsnorm(x) * g @ W^T, and no further from it than the two-launch path (add_rmsnorm,
    then the GEMM) is."""
    from generation_service.kernels.decode_fused import silu_mul
    from generation_service.kernels.gemv import RowRms, gemv, gemv_gate_up_silu
    from generation_service.kernels.rmsnorm import rmsnorm_torch
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn((2 if fused else 1) * n, k, device="cuda", generator=gen).div_(k ** 0.5).bfloat16()
    g = (1 + 0.3 * torch.randn(k, device="cuda", generator=gen)).bfloat16()
    folded = (w * g).bfloat16()
    for m in (1, 3, 8):
        h = rows_of_scales(m, k, gen)
        chunks = torch.tensor_split(h.float().pow(2), 128, dim=1)  # as 128 producer programs
        rms = RowRms(torch.stack([c.sum(1) for c in chunks], dim=1).contiguous(), EPS)
        h64 = h.double()
        y64 = F.linear(h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + EPS) * g.double(),
                       w.double())
        two_launch = F.linear(rmsnorm_torch(h, g, EPS), w)
        if fused:
            gate, up = y64.chunk(2, dim=1)
            ref, two_launch = F.silu(gate) * up, silu_mul(two_launch)
        else:
            ref = y64
        bound = 1.5 * rel_err(two_launch, ref) + 1e-4
        for cfg in configs(m, n, k, fused):
            out = (gemv_gate_up_silu(h, folded, config=cfg, rms=rms) if fused
                   else gemv(h, folded, config=cfg, rms=rms))
            err = rel_err(out, ref)
            assert out.shape == (m, n) and err < 8e-3 and err < bound, (m, str(cfg), err, bound)


@pytest.fixture(scope="module")
def normed_model():
    """The small 1B-shape model with norm weights 1 + 0.3 N(0, 1)."""
    from generation_service.model.random_init import build_random_model
    model = build_random_model(small_config(), torch.device("cuda"), torch.bfloat16, seed=0)
    gen = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, device="cuda", generator=gen))
    return model


def _every_projection_triton(m, weight, *, fused=False, pdl=None):
    """A stand-in for gemv.measured_config that sends every projection to Triton."""
    from generation_service.kernels.gemv import candidate_configs
    n = weight.shape[0] // (2 if fused else 1)
    return candidate_configs(m, n, weight.shape[1], fused=fused)[0]


@pytest.mark.parametrize("batch,plan", [(1, "measured"), (3, "measured"), (3, "every_projection")])
def test_decode_fold_on_off_match_the_model(normed_model, batch, plan, monkeypatch):
    """Eager logits with the norms folded and not (same folded weights) both within bf16
    tolerance of the model's own forward and of each other; the folded step's graph samples the
    argmax of its eager logits. measured: the 1B table folds both norms at bucket 1 under PDL
    (the post-attention norm only without), nothing at bucket 4; every_projection: both."""
    from generation_service.engine.cuda_graphs import bucket_for
    from generation_service.kernels import gemv, pdl
    from generation_service.model.forward_batch import build_forward_batch
    model = normed_model
    if plan == "every_projection":
        monkeypatch.setattr(gemv, "measured_config", _every_projection_triton)
    kv = make_kv(model.config, 1 + 4 * PAGES_PER_ROW)
    runner = GpuDecodeRunner(model, kv, max_batch=4, buckets=(1, 2, 4))
    bucket = bucket_for(batch, runner.buckets)
    folded = {k for k, v in runner.forward.gemv_plan(bucket).items() if v == "folded"}
    if plan == "every_projection":
        expected = {"input_norm", "post_attention_norm"}
    elif bucket == 1:
        expected = {"post_attention_norm"} | ({"input_norm"} if pdl.pdl_on(model.output_weight) else set())
    else:
        expected = set()
    assert folded == expected, folded
    ids, table = load_rows(runner, batch, CONTEXT, PAGES_PER_ROW)
    ref_kv = make_kv(model.config, 1 + 4 * PAGES_PER_ROW)  # same seed -> same contents
    fb = build_forward_batch([[int(t)] for t in ids], [CONTEXT] * batch, table.tolist(), device="cuda")
    logits = {}
    with torch.no_grad():
        ref = model(fb, ref_kv)
        for fold_norms in (False, True):  # True last: the graph below is captured folded
            runner.forward.fold_norms = fold_norms
            runner.buffers.scrub_tail(batch, bucket)
            logits[fold_norms] = runner.decode_forward(bucket)[:batch].float()
            err = rel_err(logits[fold_norms], ref)
            assert torch.isfinite(logits[fold_norms]).all() and err < 2e-2, (fold_norms, err)
        assert rel_err(logits[True], logits[False]) < 2e-2
        runner.capture()
        load_rows(runner, batch, CONTEXT, PAGES_PER_ROW)  # the same rows again after capture
        runner.step(batch)
    torch.cuda.synchronize()
    tokens = runner.buffers.out_tokens[:batch].long()
    rows = torch.arange(batch, device="cuda")
    assert torch.equal(logits[True][rows, tokens], logits[True].max(dim=-1).values)
    runner.close()
