"""kernels/gemv.py (skinny GEMMs for decode) vs torch, in Triton's interpreter.

fp32/fp16 only here (the interpreter's bf16 tl.dot is broken, conftest.py); bf16 on the real
shapes, under CUDA graphs and inside the decode forward: tests/gpu/test_gemv.py.
"""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
gemv_mod = pytest.importorskip("generation_service.kernels.gemv")

from generation_service.kernels.decode_fused import silu_mul  # noqa: E402

# fp16 output rounding alone is ~3e-4 relative (rms); a lost or doubled K tile is >= 5e-2
BOUND = {torch.float32: 1e-5, torch.float16: 1.5e-3}


def small(cfg):
    """A candidate config with tiles cut to the test shapes (keeps the interpreter quick)."""
    return dataclasses.replace(cfg, block_n=min(cfg.block_n, 64), block_k=min(cfg.block_k, 128))


def operands(m, n, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(64, 128), (256, 512), (100, 200)])  # last: masked N and K tails
def test_gemv_every_candidate_matches_reference(rel_err, dtype, m, n, k):
    x, w, b = operands(m, n, k, dtype)
    for bias in (None, b):
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        for cfg in map(small, gemv_mod.candidate_configs(m, n, k)):
            out = gemv_mod.gemv(x, w, bias, config=cfg)
            assert out.shape == (m, n) and out.dtype == dtype
            assert rel_err(out, ref) < BOUND[dtype], (cfg, bias is not None)


def test_gemv_default_config_and_strided_rows(rel_err):
    """x rows with a stride (a view of a wider buffer) and the table's own first config."""
    x, w, _ = operands(4, 128, 256, torch.float16, seed=1)
    wide = torch.zeros(4, 384, dtype=torch.float16)
    wide[:, :256] = x
    out = gemv_mod.gemv(wide[:, :256], w)
    assert rel_err(out, F.linear(x.float(), w.float())) < BOUND[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("i,k", [(64, 128), (96, 320)])
def test_gate_up_silu_matches_silu_mul(rel_err, dtype, m, i, k):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(m, k, generator=gen).to(dtype)
    gate_up = (torch.randn(2 * i, k, generator=gen) / k ** 0.5).to(dtype)
    unfused = silu_mul(F.linear(x, gate_up))  # what the cuBLAS path computes
    gate, up = F.linear(x.float(), gate_up.float()).chunk(2, dim=1)
    ref = F.silu(gate) * up
    for cfg in map(small, gemv_mod.candidate_configs(m, i, k, fused=True)):
        out = gemv_mod.gemv_gate_up_silu(x, gate_up, config=cfg)
        assert out.shape == (m, i) and out.dtype == dtype
        assert rel_err(out, ref) < 2 * BOUND[dtype], cfg
        # same rounding steps as silu_mul: only the GEMM's summation order differs, so in fp16
        # almost every element is bit-equal (a missing rounding of gate, up or silu breaks
        # ~1 in 4; fp32 has no rounding to hide the summation order)
        assert rel_err(out, unfused) < 2 * BOUND[dtype], cfg
        if dtype == torch.float16:
            assert (out == unfused).float().mean().item() > 0.9, cfg


EPS = 1e-5


def rows_of_scales(m, k, dtype, seed):
    """(m, k) rows of very different RMS (1/4 .. 4): a norm applied to the wrong row shows."""
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.linspace(-2, 2, m)[:, None]
    return (torch.randn(m, k, generator=gen) * scale).to(dtype)


def rmsnorm64(h, g):
    """rmsnorm(h) * g in float64: the reference the folded norm approximates."""
    h = h.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * g.double()


def row_rms(h, num_sums):
    """A RowRms of h as a producer with num_sums programs would leave it (ragged chunks)."""
    chunks = torch.tensor_split(h.float().pow(2), num_sums, dim=1)
    return gemv_mod.RowRms(torch.stack([c.sum(1) for c in chunks], dim=1).contiguous(), EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(64, 128), (100, 200)])  # last: masked N and K tails
def test_add_residual_is_the_rounded_add_and_its_sums_of_squares(rel_err, dtype, m, n, k):
    """The producer: h = residual + the GEMM's output, rounded as add_rmsnorm rounds it (so
    bit-equal to the plain GEMM's output + residual in torch), residual untouched, and each
    program's sums of h^2 over its columns."""
    x, w, b = operands(m, n, k, dtype, seed=3)
    residual = rows_of_scales(m, n, dtype, seed=4)
    kept = residual.clone()
    for bias in (None, b):
        for cfg in map(small, gemv_mod.candidate_configs(m, n, k)):
            h, rms = gemv_mod.gemv_add_residual(x, w, bias, residual, EPS, config=cfg)
            assert torch.equal(residual, kept), cfg  # out of place
            assert torch.equal(h, gemv_mod.gemv(x, w, bias, config=cfg) + residual), cfg
            assert rel_err(h, F.linear(x.float(), w.float(), None if bias is None else bias.float())
                           + residual.float()) < BOUND[dtype], cfg
            num_programs = -(-n // cfg.block_n)
            assert rms.eps == EPS and rms.sum_sq.shape == (m, num_programs)
            assert rms.sum_sq.dtype == torch.float32
            want = h.float().pow(2).split(cfg.block_n, dim=1)  # program p: columns p * BLOCK_N..
            want = torch.stack([c.sum(1) for c in want], dim=1)
            assert rel_err(rms.sum_sq, want) < 1e-6, cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k,num_sums", [(64, 128, 4), (100, 200, 5)])  # ragged: masked tails
def test_rms_scale_is_the_gemm_of_the_normalised_rows(rel_err, dtype, m, n, k, num_sums):
    """The consumer: x raw with its RowRms and the norm weight folded into W gives
    F.linear(rmsnorm(x) * g, W, bias) (the unfolded two-launch path) up to rounding."""
    from generation_service.kernels.rmsnorm import rmsnorm_torch
    h = rows_of_scales(m, k, dtype, seed=5)
    _, w, b = operands(m, n, k, dtype, seed=6)
    g = (1 + 0.3 * torch.randn(k, generator=torch.Generator().manual_seed(7))).to(dtype)
    folded = (w * g).to(dtype)  # as fuse_layer_weights folds it
    rms = row_rms(h, num_sums)
    two_launch = F.linear(rmsnorm_torch(h, g, EPS), w)  # what the unfolded path computes
    for bias in (None, b):
        ref = F.linear(rmsnorm64(h, g), w.double(), None if bias is None else bias.double())
        for cfg in map(small, gemv_mod.candidate_configs(m, n, k)):
            out = gemv_mod.gemv(h, folded, bias, config=cfg, rms=rms)
            assert out.shape == (m, n) and out.dtype == dtype
            assert rel_err(out, ref) < 2 * BOUND[dtype], (cfg, bias is not None)
            if bias is None:
                assert rel_err(out, two_launch) < 2 * BOUND[dtype], cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gate_up_silu_rms_scale(rel_err, dtype, m):
    """The consumer with silu * up: both accumulators scaled before the rounding and silu."""
    i, k = 96, 320
    h = rows_of_scales(m, k, dtype, seed=8)
    gen = torch.Generator().manual_seed(9)
    gate_up = (torch.randn(2 * i, k, generator=gen) / k ** 0.5).to(dtype)
    g = (1 + 0.3 * torch.randn(k, generator=gen)).to(dtype)
    gate, up = F.linear(rmsnorm64(h, g), gate_up.double()).chunk(2, dim=1)
    ref = F.silu(gate) * up
    for cfg in map(small, gemv_mod.candidate_configs(m, i, k, fused=True)):
        out = gemv_mod.gemv_gate_up_silu(h, (gate_up * g).to(dtype), config=cfg, rms=row_rms(h, 3))
        assert out.shape == (m, i) and out.dtype == dtype
        assert rel_err(out, ref) < 3 * BOUND[dtype], cfg


@pytest.mark.parametrize("m", [1, 3])
def test_producer_then_consumer_is_add_rmsnorm_then_gemm(rel_err, m):
    """o_proj -> post-attention norm -> gate_up as the fused decode forward chains them: the
    consumer reads the producer's sums of squares as they are laid out, whatever its config."""
    dtype, hidden, q_dim, i = torch.float16, 96, 64, 48
    o, w_o, _ = operands(m, hidden, q_dim, dtype, seed=10)
    residual = rows_of_scales(m, hidden, dtype, seed=11)
    gen = torch.Generator().manual_seed(12)
    gate_up = (torch.randn(2 * i, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    g = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)
    h_ref = (F.linear(o.float(), w_o.float()) + residual.float())
    gate, up = F.linear(rmsnorm64(h_ref, g), gate_up.double()).chunk(2, dim=1)
    ref = F.silu(gate) * up
    producers = map(small, gemv_mod.candidate_configs(m, hidden, q_dim))
    consumers = list(map(small, gemv_mod.candidate_configs(m, i, hidden, fused=True)))
    for p_cfg in producers:
        h, rms = gemv_mod.gemv_add_residual(o, w_o, None, residual, EPS, config=p_cfg)
        for c_cfg in consumers:
            out = gemv_mod.gemv_gate_up_silu(h, (gate_up * g).to(dtype), config=c_cfg, rms=rms)
            assert rel_err(out, ref) < 3 * BOUND[dtype], (p_cfg, c_cfg)


def test_rejects_what_it_cannot_serve():
    x, w, _ = operands(17, 64, 128, torch.float32)
    with pytest.raises(AssertionError):
        gemv_mod.gemv(x, w)  # more than MAX_ROWS rows
    row = gemv_mod.GemvConfig(16, 128, use_dot=False)
    with pytest.raises(AssertionError):
        gemv_mod.gemv(x[:2], w, config=row)  # the CUDA-core kernel is M = 1 only
    rms = row_rms(x[:2], 2)
    with pytest.raises(AssertionError):
        gemv_mod.linear(x[:2], w, rms=rms)  # unmeasured: cuBLAS, which cannot fold a norm
    n = gemv_mod.MAX_SUMS + 1  # one column a program: more sums of squares than a consumer loads
    with pytest.raises(AssertionError):
        gemv_mod.gemv_add_residual(x[:2], torch.zeros(n, 128), None, torch.zeros(2, n), EPS,
                                   config=gemv_mod.GemvConfig(1, 128))


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (14336, 4096), (4096, 14336),
                                 (131072, 4096), (3072, 2048), (2048, 8192), (8192, 2048)])
def test_table_fills_the_h200(n, k):
    """Every 8B/1B decode shape gets >= 128 programs without split-K (>= 256 from N = 4096),
    the dot configs fit 2 programs per SM (shared memory <= 113 KiB each) and the row
    kernel's partial sums fit in registers."""
    for m in (1, 8):
        for fused in (False, True) if n <= 32768 else (False,):  # fused: I columns
            configs = gemv_mod.candidate_configs(m, n, k, fused=fused)
            assert configs[0].use_dot and len(configs) >= 2 + (m == 1)
            programs = -(-n // configs[0].block_n)
            assert programs >= (256 if n >= 4096 else 128), (n, configs[0])
            w_tiles = 2 if fused else 1
            for c in configs:
                smem = c.num_stages * c.block_k * (w_tiles * c.block_n + 16) * 2
                assert not c.use_dot or smem <= 113 * 1024, c
                # the row kernel's fp32 partials: <= 64 registers a thread (no spills)
                assert c.use_dot or w_tiles * c.block_n * c.block_k <= gemv_mod.ROW_TILE, c


COMPILE = """
import sys
sys.path.insert(0, "tests/unit/kernels")
from sm90_compile import BF, F32, N, compile_sm90, resource_usage
from generation_service.kernels import gemv as g
# (mode, the flags it sets): plain, a folded norm's producer and its consumer
modes = (("plain", {}), ("add_residual", dict(ADD_RESIDUAL=True)),
         ("rms_scale", dict(RMS_SCALE=True, BLOCK_S=128)))
for bn, bk, silu in ((16, 256, False), (32, 256, False), (64, 128, False), (32, 128, True),
                     (64, 64, True)):
    for mode, flags in modes:
        if silu and mode == "add_residual":
            continue
        flags = dict(dict(ADD_RESIDUAL=False, RMS_SCALE=False, BLOCK_S=1, W_SCALE=False), **flags)
        k = compile_sm90(g._gemv_dot_kernel, BF, BF, BF, BF, 7, N, N, N, N, N, BF, F32, N, 128,
                         1e-5, F32, HAS_BIAS=not silu, SILU_MUL=silu, EVEN=True, BLOCK_M=16,
                         BLOCK_N=bn, BLOCK_K=bk, PDL=silu, num_stages=4, **flags)
        print("dot", bn, bk, silu, mode, resource_usage(k), "cp.async" in k.asm["ptx"])
for silu in (False, True):
    for mode, flags in modes:
        if silu and mode == "add_residual":
            continue
        flags = dict(dict(ADD_RESIDUAL=False, RMS_SCALE=False, BLOCK_S=1, W_SCALE=False), **flags)
        k = compile_sm90(g._gemv_row_kernel, BF, BF, BF, BF, N, N, N, BF, F32, 128, 1e-5, F32,
                         HAS_BIAS=not silu, SILU_MUL=silu, EVEN=True, BLOCK_N=16,
                         BLOCK_K=256 if silu else 512, PDL=silu, num_stages=3, **flags)
        print("row", silu, mode, resource_usage(k))
"""


def test_gemv_compile_sm90():
    """Both kernels compile for the H200 (sm_90) with W tiles pipelined by cp.async, plain and
    as a folded RMSNorm's producer (add_residual) and consumer (rms_scale), without spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", COMPILE], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    if "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("triton without its bundled ptxas")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 13 + 5 and all("STACK:0" in line for line in lines), proc.stdout
    assert all(line.endswith("True") for line in lines if line.startswith("dot")), proc.stdout


H200_RUN = Path(__file__).resolve().parents[3] / "benchmarks/results/kernels-gemv-h200.json"


def weight(n, k, dtype=torch.bfloat16):
    return torch.empty(n, k, dtype=dtype, device="meta")  # shape and dtype only


@pytest.mark.parametrize("n,k,fused,dtype,m", [
    (5120, 5120, False, torch.bfloat16, 1),  # a shape nobody measured
    (28672, 4096, False, torch.bfloat16, 1),  # 8B gate_up measured fused only
    (4096, 4096, False, torch.float16, 1),  # 8B o_proj measured in bf16 only
    (4096, 4096, False, torch.bfloat16, 16),  # rows measured up to 8
    (6144, 4096, False, torch.bfloat16, 1),  # 8B qkv: cuBLAS won
    (4096, 14336, False, torch.bfloat16, 8),  # 8B down: cuBLAS won
    (2048, 2048, False, torch.bfloat16, 2),  # 1B o_proj: Triton won at M = 1 only
    (2048, 8192, False, torch.bfloat16, 1),  # 1B down M = 1: a 0.3% tie
])
def test_table_picks_cublas_unless_triton_was_measured_faster(n, k, fused, dtype, m):
    assert gemv_mod.measured_config(m, weight(n, k, dtype), fused=fused, pdl=False) is gemv_mod.CUBLAS


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 14336), (3072, 2048), (2048, 2048),
                                 (2048, 8192)])
def test_one_row_under_pdl_runs_the_one_row_table(n, k):
    """Under PDL the 1-row step runs qkv, o_proj and down on PDL_M1's Triton configs (the
    one-row sweep's winners); more rows, or no PDL, keep MEASURED's choice."""
    w = weight(n, k)
    assert gemv_mod.measured_config(1, w, pdl=True) == gemv_mod.PDL_M1[(n, k, False)]
    assert gemv_mod.measured_config(2, w, pdl=True) == gemv_mod.measured_config(2, w, pdl=False)
    assert gemv_mod.measured_config(1, w, pdl=False) != gemv_mod.PDL_M1[(n, k, False)]
    assert gemv_mod.measured_config(1, weight(n, k, torch.float16), pdl=True) is gemv_mod.CUBLAS


@pytest.mark.parametrize("n,k,fused,rows,expected", [
    (4096, 4096, False, (1, 2, 3, 8), "dot n32 k256 w4 s4"),  # 8B o_proj
    (28672, 4096, True, (1, 2, 5, 8), "dot n64 k64 w4 s4"),  # 8B gate_up + silu
    (131072, 4096, False, (1, 4, 8), "dot n64 k128 w4 s4"),  # 8B LM head
    (2048, 2048, False, (1,), "row n16 k512 w4 s3"),  # 1B o_proj
    (16384, 2048, True, (1, 8), "dot n32 k128 w4 s4"),  # 1B gate_up + silu
    (131072, 2048, False, (1, 8), "dot n64 k128 w4 s4"),  # 1B LM head
])
def test_table_picks_the_measured_triton_winners(n, k, fused, rows, expected):
    for m in rows:
        assert str(gemv_mod.measured_config(m, weight(n, k), fused=fused, pdl=False)) == expected, m


def test_table_follows_the_h200_run():
    """MEASURED is the rule (Triton's best config where it beat cuBLAS by MIN_GAIN, else cuBLAS)
    applied to the JSON its comment cites: a new run must come with a new table."""
    import json
    if not H200_RUN.exists():
        pytest.skip(f"{H200_RUN} not in this checkout")
    runs = {}
    for rec in json.loads(H200_RUN.read_text())["results"]:
        if rec.get("kernel") == "gemv" and "error" not in rec:
            key = (rec["n"], rec["k"], rec["shape"] == "gate_up", rec["m"])
            runs.setdefault(key, []).append(rec)
    assert len(runs) == 40  # 2 models x 5 projections x M = 1, 2, 4, 8
    for (n, k, fused, m), recs in runs.items():
        best = min(recs, key=lambda r: r["triton_us"])
        wins = best["triton_us"] <= (1 - gemv_mod.MIN_GAIN) * best["cublas_us"]
        got = gemv_mod.measured_config(m, weight(n, k), fused=fused, pdl=False)
        assert (str(got) == best["config"]) if wins else got is gemv_mod.CUBLAS, (best["case"], got)


def test_linear_and_gate_up_silu_dispatch_on_the_table(monkeypatch):
    """Measured winners go to the Triton kernels with the table's config; anything else is
    exactly the cuBLAS path (F.linear, silu_mul(F.linear))."""
    calls = []
    monkeypatch.setattr(gemv_mod, "gemv", lambda x, w, b=None, config=None, rms=None: calls.append(
        ("gemv", str(config))) or x.new_empty(x.shape[0], w.shape[0]))
    monkeypatch.setattr(gemv_mod, "gemv_gate_up_silu", lambda x, w, config=None, rms=None: calls.append(
        ("gate_up_silu", str(config))) or x.new_empty(x.shape[0], w.shape[0] // 2))
    x = torch.empty(2, 4096, dtype=torch.bfloat16, device="meta")
    assert gemv_mod.linear(x, weight(131072, 4096)).shape == (2, 131072)
    assert gemv_mod.gate_up_silu(x, weight(28672, 4096)).shape == (2, 14336)
    assert calls == [("gemv", "dot n64 k128 w4 s4"), ("gate_up_silu", "dot n64 k64 w4 s4")]
    assert gemv_mod.linear(x, weight(6144, 4096)).shape == (2, 6144)  # 8B qkv: cuBLAS
    assert len(calls) == 2
    x, w, b = operands(3, 96, 64, torch.float32)  # unmeasured: bit-equal to the cuBLAS path
    assert torch.equal(gemv_mod.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(gemv_mod.gate_up_silu(x, w), silu_mul(F.linear(x, w)))
    assert len(calls) == 2
