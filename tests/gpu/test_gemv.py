"""kernels/gemv.py on the GPU: bf16 on the 8B/1B decode shapes vs an fp32 reference, graph
replay == eager, and the decode forward with gemv_max_batch > 0 (the measured hybrid, and every
projection on Triton) vs the cuBLAS forward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_helpers import load_rows, make_kv
from generation_service.engine.gpu_runner import GpuDecodeRunner

pytestmark = pytest.mark.gpu
CONTEXT = 40
PAGES_PER_ROW = 8
# (N, K): 8B qkv, o, down, LM head; 1B qkv, down; an uneven tail
SHAPES = [(6144, 4096), (4096, 4096), (4096, 14336), (131072, 4096), (3072, 2048),
          (2048, 8192), (1000, 1000)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_bf16_every_candidate(n, k):
    from generation_service.kernels.gemv import candidate_configs, gemv
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen).div_(k ** 0.5).bfloat16()
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    w32 = w.float()
    for m in (1, 2, 4, 8, 16):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        for b in (None, bias):
            ref = F.linear(x.float(), w32, None if b is None else b.float())
            cublas = rel_err(F.linear(x, w, b), ref)  # ~1e-3: the bf16 output rounding
            for cfg in candidate_configs(m, n, k):
                err = rel_err(gemv(x, w, b, config=cfg), ref)
                assert err < 4e-3 and err < 1.5 * cublas + 1e-4, (m, str(cfg), err, cublas)


@pytest.mark.parametrize("i,k", [(14336, 4096), (8192, 2048), (1000, 1000)])
def test_gate_up_silu_bf16_matches_silu_mul(i, k):
    from generation_service.kernels.decode_fused import silu_mul
    from generation_service.kernels.gemv import candidate_configs, gemv_gate_up_silu
    gen = torch.Generator(device="cuda").manual_seed(1)
    gate_up = torch.randn(2 * i, k, device="cuda", generator=gen).div_(k ** 0.5).bfloat16()
    for m in (1, 3, 8):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        unfused = silu_mul(F.linear(x, gate_up)).float()
        for cfg in candidate_configs(m, i, k, fused=True):
            out = gemv_gate_up_silu(x, gate_up, config=cfg).float()
            # same rounding steps: most elements bit-equal, the rest one bf16 step of gate/up
            assert rel_err(out, unfused) < 8e-3, (m, str(cfg))
            assert (out == unfused).float().mean().item() > 0.8, (m, str(cfg))


def test_gemv_graph_replay_equals_eager():
    from generation_service.kernels.gemv import gemv, gemv_gate_up_silu
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 2048, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(2 * 8192, 2048, device="cuda", dtype=torch.bfloat16)
    gemv(x, w), gemv_gate_up_silu(x, gate_up)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, h = gemv(x, w), gemv_gate_up_silu(x, gate_up)
    for _ in range(2):
        x.normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, gemv(x, w)) and torch.equal(h, gemv_gate_up_silu(x, gate_up))


def _runner(model, gemv_max_batch: int) -> GpuDecodeRunner:
    kv = make_kv(model.config, 1 + 8 * PAGES_PER_ROW)  # same seed: same cache in both runners
    runner = GpuDecodeRunner(model, kv, max_batch=8, buckets=(1, 2, 4, 8))
    runner.forward.gemv_max_batch = gemv_max_batch  # read per call: before capture
    return runner


def _every_projection_triton(m, weight, *, fused=False):
    """A stand-in for gemv.measured_config that sends every projection to Triton."""
    from generation_service.kernels.gemv import candidate_configs
    n = weight.shape[0] // (2 if fused else 1)
    return candidate_configs(m, n, weight.shape[1], fused=fused)[0]


@pytest.mark.parametrize("plan", ["measured", "every_projection"])
@pytest.mark.parametrize("batch", [1, 5])
def test_decode_with_gemv_matches_cublas(model, batch, plan, monkeypatch):
    """plan "measured": the table's hybrid (the fixture has the 1B shapes: at bucket 1 o_proj,
    gate_up+silu and the LM head run Triton, with PDL on qkv and down too; at bucket 8
    gate_up+silu and the LM head); "every_projection":
    Triton for all five, so qkv and down run inside the forward too.
    Per step: eager logits of the gemv forward within bf16 tolerance of the cuBLAS one;
    the gemv graph's token is an argmax of its eager logits (graph == eager); where the two
    runners' tokens differ, the cuBLAS logits have a near tie there (gap <= 2 x the largest
    logit difference of that row). The cuBLAS runner is teacher-forced with the gemv tokens,
    so both caches hold the same sequence."""
    from generation_service.engine.cuda_graphs import bucket_for
    from generation_service.kernels import gemv, pdl
    if plan == "every_projection":
        monkeypatch.setattr(gemv, "measured_config", _every_projection_triton)
    gemv_runner, cublas_runner = _runner(model, 8), _runner(model, 0)
    bucket = bucket_for(batch, gemv_runner.buckets)
    projections = {"qkv", "o_proj", "gate_up_silu", "down", "lm_head"}
    triton = {k for k, v in gemv_runner.forward.gemv_plan(bucket).items()
              if k in projections and v != "cublas"}
    one_row = {"o_proj", "qkv", "down"} if pdl.pdl_on(model.output_weight) else {"o_proj"}  # gemv.PDL_M1
    expected = {"gate_up_silu", "lm_head"} | (one_row if bucket == 1 else set())
    assert triton == (projections if plan == "every_projection" else expected), triton
    same, steps, worst = 0, 6, 0.0
    with torch.no_grad():
        for runner in (gemv_runner, cublas_runner):
            runner.capture()
            load_rows(runner, batch, CONTEXT, PAGES_PER_ROW)
        seen = []
        for _ in range(steps):
            logits = []
            for runner in (gemv_runner, cublas_runner):
                runner.buffers.scrub_tail(batch, bucket)
                logits.append(runner.decode_forward(bucket)[:batch].float())  # same K/V as the step
                runner.step(batch)
            lg, lc = logits
            err = rel_err(lg, lc)
            assert torch.isfinite(lg).all() and err < 2e-2, err
            worst = max(worst, err)
            tok_g = gemv_runner.buffers.out_tokens[:batch].clone()
            tok_c = cublas_runner.buffers.out_tokens[:batch].clone()
            rows = torch.arange(batch, device="cuda")
            assert torch.equal(lg[rows, tok_g], lg.max(dim=-1).values)
            # lg[tok_g] >= lg[j] for the cuBLAS argmax j, so lc[j] - lc[tok_g] <= 2 max|lg - lc|
            gap = lc.max(dim=-1).values - lc[rows, tok_g]
            bound = 2 * (lg - lc).abs().max(dim=-1).values
            assert (gap <= bound).all(), (gap, bound)
            same += int((tok_g == tok_c).sum())
            seen.append(tok_g)
            cublas_runner.buffers.input_ids[:batch].copy_(tok_g)  # teacher-force
    torch.cuda.synchronize()
    for runner in (gemv_runner, cublas_runner):
        runner.close()
    print(f"batch {batch} {plan}: {same}/{steps * batch} greedy tokens identical to cuBLAS, "
          f"logits rel err <= {worst:.2e}")
    if batch > 1:  # one row of a random model may repeat a token; several rows do not
        assert len(set(torch.stack(seen).flatten().tolist())) > 1  # not a constant output
