"""Skinny GEMMs for decode (Triton): y (M, N) = x (M, K) @ W^T (+ bias), W (N, K) row-major
(the nn.Linear layout), M <= 16 rows, fp32 accumulation, output in x's dtype.

Why: at M = 1..8 every projection of a decode step is a GEMV, bound by reading W once
(the 8B projections + LM head alone stream at ~88% of the copy bandwidth under cuBLAS on an
H200). Design for bandwidth:
- each program owns BLOCK_N output columns and streams those W rows across K in
  (BLOCK_N, BLOCK_K) tiles, 128-bit loads along K, pipelined `num_stages` deep; x's K tile is
  loaded once per step and serves all M rows;
- no split-K: BLOCK_N is chosen so N / BLOCK_N >= ~2 x the H200's 132 SMs (N = 4096 at
  BLOCK_N 16: 256 programs). Every 8B projection has N >= 4096, so the grid fills the chip
  without a second reduction launch and an fp32 partials round trip. Only the 1B o_proj
  (N = 2048: 128 programs) is under 2 waves' worth;
- two kernels: `_gemv_dot_kernel` (tensor cores, swap-AB: acc^T (BLOCK_N, 16) = W tile @ x^T,
  x padded to one 16-wide MMA tile, any M <= 16) and `_gemv_row_kernel` (M = 1 on CUDA cores:
  fp32 partial products per (n, k) lane, one reduction after the K loop);
- `gemv_gate_up_silu`: the MLP's fused [gate; up] weight -> silu(gate) * up directly, each
  program streaming matching gate and up rows; gate and up are rounded to the output dtype
  before silu * up, as `decode_fused.silu_mul(F.linear(x, gate_up))` rounds them.

Folded RMSNorm (the decode forward's o_proj -> norm -> gate_up and down -> norm -> next qkv,
where both GEMMs run here): the norm's weight g is folded into the consumer's weight at load
(W * g, `decode_forward.fuse_layer_weights`), and the rest of the norm splits across the two
GEMMs, so the add_rmsnorm launch between them goes. The producer (`gemv_add_residual`,
ADD_RESIDUAL) writes h = residual + its output, rounded as add_rmsnorm rounds it, and per row
each program's sum of h^2 over its columns (`RowRms`: fp32, no atomics, deterministic); the
consumer (`rms=`, RMS_SCALE) reads h raw and, after its K loop, scales the fp32 accumulators by
rsqrt(sum / K + eps). Its K loop is the plain kernel's: the same instructions in the sm_90 SASS
and the same registers (the partial sums load after it); with the flags off the kernels compile
to the plain ones. Numerics: h @ (W * g)^T * r instead of (rmsnorm(h) * g) @ W^T: bf16 rounding
of W * g in place of two roundings of the normalised input.

Configs: no autotuning (autotune would sync and time inside a graph capture). `candidate_configs`
gives 2-4 configs per shape (a first guess, then alternatives); benchmarks/kernels.py
(`--only gemv`) times every candidate against cuBLAS. The H200 run showed the first guesses
mostly losing and cuBLAS winning some shapes outright (qkv, down), so the choice is measured:
`MEASURED` maps (weight shape, rows) to the winning config or to cuBLAS, and `linear` /
`gate_up_silu` dispatch on it. Unmeasured shapes (other models, other dtypes, M > 8) run cuBLAS.
NOTE: the winners run fewer, larger programs than the "2 programs per SM" rule above suggests
(8B o_proj: BLOCK_N 32 = 128 programs), so that rule is a starting point, not a law.
Used by `engine/decode_forward.py` for buckets <= `gemv_max_batch`.

FP8 weights (`Fp8Weight`: e4m3 rows, one fp32 scale per output channel): the same kernels
stream W at one byte an element, widen each tile to x's dtype in registers, and scale the fp32
accumulators by the rows' scales after the K loop (W_SCALE); x stays in its dtype (decode runs
W8A16; the prefill GEMMs quantize activations too, `fp8_gemm.py`). `linear` / `gate_up_silu`
take them with FP8_CONFIGS, which no table measured yet.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from generation_service.model.quantization.weight import Fp8Weight

from .decode_fused import silu_mul
from .pdl import pdl_launch, pdl_launch_dependents, pdl_on, pdl_wait

MAX_ROWS = 16  # the dot kernel pads x's rows to one 16-wide MMA tile
NUM_SMS = 132  # H200; the table below targets >= 2 programs per SM
EVICT: tl.constexpr = tl.constexpr("evict_first")  # W is read once a step: keep L2 for the rest


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration. use_dot=False (the CUDA-core kernel) serves M = 1 only."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    use_dot: bool = True

    def __str__(self) -> str:
        kind = "dot" if self.use_dot else "row"
        return f"{kind} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True)
class RowRms:
    """The RMS of each row of h (M, K), left in pieces by the GEMM that wrote h (its
    ADD_RESIDUAL epilogue): sum_sq[m, p] = sum of h[m, n]^2 in fp32 over producer program p's
    columns. A consumer GEMM (`gemv(..., rms=)`) finishes it: rsqrt(sum_sq[m].sum() / K + eps)."""

    sum_sq: torch.Tensor  # (M, P) fp32, contiguous
    eps: float


MAX_SUMS = 512  # a consumer loads a row's partial sums as one tile: the producer's programs

# Keyed by output columns N (fused gate/up: I): the first row whose bound holds. Shared memory
# per dot program = num_stages * BLOCK_K * (BLOCK_N + 16) * 2 bytes (W tile + x tile):
# 64-96 KiB, so 2-3 programs fit an SM. (max N, candidates; the first is `gemv`'s fallback
# where MEASURED has no Triton config)
_TABLE: tuple[tuple[int | None, tuple[GemvConfig, ...]], ...] = (
    (8192, (GemvConfig(16, 256), GemvConfig(32, 256), GemvConfig(16, 512, num_stages=3))),
    (32768, (GemvConfig(32, 256), GemvConfig(64, 128), GemvConfig(16, 256))),
    (None, (GemvConfig(64, 128), GemvConfig(128, 64), GemvConfig(32, 256))),
)
ROW_TILE = 8192  # row kernel: BLOCK_N * BLOCK_K fp32 partials = 64 registers a thread at 4 warps

CUBLAS = None  # a MEASURED choice: F.linear (cuBLAS) beat every Triton candidate
MIN_GAIN = 0.01  # Triton's best must beat cuBLAS by >= 1%: ties (<= 0.4% in the run) go to cuBLAS

# Measured with `benchmarks/kernels.py --only gemv,gemv_decode` on one H200 (bf16, each projection
# a CUDA graph of one launch per layer over distinct weights; gate_up is the fused
# gemv_gate_up_silu vs F.linear + silu_mul; docs/gpu.md, "The decode forward").
# (weight rows, K, fused) -> ((max rows, choice), ...) by ascending max rows; rows measured:
# 1, 2, 4, 8. choice: the fastest Triton config where it beat cuBLAS by MIN_GAIN at every measured
# row count of the range, else CUBLAS. Comments: us per call, cuBLAS -> that config (or the best
# Triton config where cuBLAS won). tests/unit/kernels/test_gemv_kernel.py re-derives this from
# that run's results: a new run means a new table.
MEASURED: dict[tuple[int, int, bool], tuple[tuple[int, GemvConfig | None], ...]] = {
    # Llama-3.1-8B: hidden 4096, intermediate 14336, 32 q / 8 kv heads x 128, vocab 131072
    (6144, 4096, False): ((8, CUBLAS),),  # qkv 15.2-15.8 -> 15.7-16.3
    (4096, 4096, False): ((8, GemvConfig(32, 256)),),  # o_proj 13.4 -> 12.3-12.5
    # gate_up+silu 58.7 (M=1), 64.0-65.0 (M=2..8) -> 57.6-58.0
    (28672, 4096, True): ((8, GemvConfig(64, 64)),),
    (4096, 14336, False): ((8, CUBLAS),),  # down 32.5-33.1 -> 33.1-34.1
    (131072, 4096, False): ((8, GemvConfig(64, 128)),),  # lm_head 266.5-268.6 -> 245.3-249.2
    # Llama-3.2-1B: hidden 2048, intermediate 8192, 32 q / 8 kv heads x 64, vocab 131072
    (3072, 2048, False): ((8, CUBLAS),),  # qkv 7.0-7.1 -> 7.06 (M=1), 7.8-7.9
    # o_proj 6.67 -> 6.37 (M=1, the CUDA-core kernel); 6.6-6.7 -> 7.0 (M=2..8)
    (2048, 2048, False): ((1, GemvConfig(16, 512, num_stages=3, use_dot=False)), (8, CUBLAS)),
    (16384, 2048, True): ((8, GemvConfig(32, 128)),),  # gate_up+silu 20.3-20.8 -> 19.0-19.4
    (2048, 8192, False): ((8, CUBLAS),),  # down 14.0-14.6 -> 14.55 (M=1), 18.2
    (131072, 2048, False): ((8, GemvConfig(64, 128)),),  # lm_head 134.3-136.1 -> 124.6-127.3
}


# One row under PDL (kernels/pdl.py): MEASURED timed each projection alone, where cuBLAS kept
# qkv and down by < 4%; in a whole decode step with PDL, Triton there lets the step's chain of
# Triton kernels overlap across them (docs/gpu.md, "The decode forward").
# The configs: the CUDA-core kernel at BLOCK_N 8 (N / 8 programs, 4-8 per SM, each streaming
# whole 1024-wide K tiles), the fastest of 9-14 candidates for every projection but gate_up
# (`kernels.py --extra-m1` on one H200, us per call, before -> this config):
PDL_M1: dict[tuple[int, int, bool], GemvConfig] = {
    (6144, 4096, False): GemvConfig(8, 1024, num_stages=3, use_dot=False),  # 8B qkv 15.2 -> 14.5
    (4096, 4096, False): GemvConfig(8, 1024, num_stages=3, use_dot=False),  # 8B o_proj 12.0 -> 10.3
    (4096, 14336, False): GemvConfig(8, 1024, num_stages=3, use_dot=False),  # 8B down 32.6 -> 29.3
    (3072, 2048, False): GemvConfig(8, 1024, num_stages=3, use_dot=False),  # 1B qkv 6.4 -> 5.0
    (2048, 2048, False): GemvConfig(8, 1024, num_stages=3, use_dot=False),  # 1B o_proj 5.8 -> 4.1
    (2048, 8192, False): GemvConfig(8, 1024, num_stages=3, use_dot=False),  # 1B down 14.2 -> 10.7
}


# FP8 weights (half the bytes of bf16): one row on CUDA cores as PDL_M1's bf16 winners, twice
# their K tile for the same bytes a stage (8 warps: the same partials a thread); more rows the dot
# kernel at the bf16 table's first guess, K tile doubled likewise. Not yet measured against alternatives.
FP8_M1 = GemvConfig(8, 2048, num_warps=8, num_stages=3, use_dot=False)


def fp8_config(m: int, n: int, k: int, *, fused: bool = False) -> GemvConfig:
    if m == 1:
        return dataclasses.replace(FP8_M1, block_k=FP8_M1.block_k // 2) if fused else FP8_M1
    first = candidate_configs(m, n, k, fused=fused)[0]
    return dataclasses.replace(first, block_k=2 * first.block_k)


def measured_config(m: int, weight: torch.Tensor | Fp8Weight, *, fused: bool = False,
                    pdl: bool | None = None) -> GemvConfig | None:
    """The Triton config that beat cuBLAS on the H200 for x (m, K) @ weight^T (fused: weight is
    [gate; up] for gemv_gate_up_silu), or None (CUBLAS): cuBLAS won, or nobody measured it.
    pdl (default: whether this weight's kernels launch with PDL, `kernels.pdl.pdl_on`): one row
    also takes PDL_M1's choices. FP8 weights always run Triton (`fp8_config`)."""
    if isinstance(weight, Fp8Weight):
        n, k = weight.shape
        return fp8_config(m, n // 2 if fused else n, k, fused=fused)
    if weight.dtype != torch.bfloat16:  # the table's numbers are bf16 only
        return CUBLAS
    key = (weight.shape[0], weight.shape[1], fused)
    if m == 1 and key in PDL_M1 and (pdl_on(weight) if pdl is None else pdl):
        return PDL_M1[key]
    return next((choice for max_m, choice in MEASURED.get(key, ()) if m <= max_m), CUBLAS)


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None,
           rms: RowRms | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) by whichever of cuBLAS and `gemv` MEASURED says is faster here.
    rms: a folded RMSNorm's consumer (`gemv`): only where MEASURED picks Triton."""
    config = measured_config(x.shape[0], weight)
    if config is CUBLAS:
        assert rms is None, "a folded RMSNorm runs in Triton GEMMs only"
        return F.linear(x, weight, bias)
    return gemv(x, weight, bias, config=config, rms=rms)


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor | Fp8Weight, rms: RowRms | None = None) -> torch.Tensor:
    """silu_mul(F.linear(x, gate_up)), or the fused `gemv_gate_up_silu` where MEASURED says it is
    faster (its timing already includes the silu_mul launch it saves). rms: as `linear`'s."""
    config = measured_config(x.shape[0], gate_up, fused=True)
    if config is CUBLAS:
        assert rms is None, "a folded RMSNorm runs in Triton GEMMs only"
        return silu_mul(F.linear(x, gate_up))
    return gemv_gate_up_silu(x, gate_up, config=config, rms=rms)


def linear_add_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        residual: torch.Tensor, eps: float) -> tuple[torch.Tensor, RowRms]:
    """`gemv_add_residual` with MEASURED's config: a folded RMSNorm's producer, Triton only."""
    config = measured_config(x.shape[0], weight)
    assert config is not CUBLAS, "a folded RMSNorm runs in Triton GEMMs only"
    return gemv_add_residual(x, weight, bias, residual, eps, config=config)


def candidate_configs(m: int, n: int, k: int, *, fused: bool = False) -> list[GemvConfig]:
    """Configs to try for an (m, n, k) GEMV, first guess first; n = output columns.
    fused (gemv_gate_up_silu): two W tiles per step, so half the K tile keeps the bytes
    (and the row kernel's two accumulators their registers)."""
    assert 1 <= m <= MAX_ROWS, m
    configs = list(next(c for bound, c in _TABLE if bound is None or n <= bound))
    if m == 1:
        block_n = configs[0].block_n
        configs.append(GemvConfig(block_n, ROW_TILE // block_n, num_stages=3, use_dot=False))
    if fused:
        configs = [dataclasses.replace(c, block_k=max(64, c.block_k // 2)) for c in configs]
    return configs


@triton.jit
def _inv_rms(sum_sq_ptr, offs_m, m_mask, num_sums, K, eps, BLOCK_S: tl.constexpr):
    """(BLOCK_M,) fp32 rsqrt(mean(x^2) + eps) of x's rows, from the sums of squares its producer
    GEMM left in sum_sq (M, num_sums), one column per producer program (`RowRms`)."""
    offs_s = tl.arange(0, BLOCK_S)
    ptrs = sum_sq_ptr + offs_m[:, None] * num_sums + offs_s[None, :]  # (BLOCK_M, BLOCK_S)
    sums = tl.load(ptrs, mask=m_mask[:, None] & (offs_s < num_sums)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(sums, axis=1) / K + eps)


@triton.jit
def _epilogue(acc_g, acc_u, bias_ptr, out_ptr, residual_ptr, sum_sq_ptr, offs_n, offs_m, n_mask,
              m_mask, stride_om, stride_rm, num_sums, HAS_BIAS: tl.constexpr,
              SILU_MUL: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
    """acc_g/acc_u (BLOCK_N, BLOCK_M) fp32 -> out[m, n] (+ bias[n]; silu(gate) * up;
    ADD_RESIDUAL: out = residual + the GEMM's output, and this program's sum of out^2 per row
    to sum_sq[m, program])."""
    dt = out_ptr.dtype.element_ty
    out = acc_g
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if SILU_MUL:
        g = out.to(dt).to(tl.float32)  # gate and up rounded as the GEMM's bf16 output would be
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu, rounded
        out = act * acc_u.to(dt).to(tl.float32)
    mask = m_mask[None, :] & n_mask[:, None]
    if ADD_RESIDUAL:  # rmsnorm.py's add: the GEMM's output rounded, plus the residual, rounded
        res_ptrs = residual_ptr + offs_m[None, :] * stride_rm + offs_n[:, None]
        res = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        h = (out.to(dt).to(tl.float32) + res).to(dt).to(tl.float32)  # 0 outside the mask
        tl.store(sum_sq_ptr + offs_m * num_sums + tl.program_id(0), tl.sum(h * h, axis=0),
                 mask=m_mask)
        out = h
    ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]  # (BLOCK_N, BLOCK_M)
    tl.store(ptrs, out.to(dt), mask=mask)


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                     residual_ptr, sum_sq_ptr, stride_rm, num_sums, eps, w_scale_ptr,
                     HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr, ADD_RESIDUAL: tl.constexpr, RMS_SCALE: tl.constexpr,
                     BLOCK_S: tl.constexpr, W_SCALE: tl.constexpr):
    # swap-AB: W's tile is the MMA's A operand (K-major as stored), x^T its B operand;
    # rows of x beyond M load as zeros. EVEN: N % BLOCK_N == 0 and K % BLOCK_K == 0.
    # RMS_SCALE (a folded RMSNorm's consumer): x is the raw residual stream and W carries the
    # norm weight; the rows' 1/rms scales the accumulators after the K loop, which stays as it
    # is (scaling x per K tile stopped Triton pipelining the W loads: 3x slower, 1B gate_up on an
    # H200; docs/gpu.md, "The decode forward").
    pdl_wait(PDL)  # before any global access (pdl.py)
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    gate_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # (BLOCK_N, BLOCK_K)
    up_ptrs = gate_ptrs + N * stride_wn  # SILU_MUL: the up rows follow the N gate rows
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # (BLOCK_K, BLOCK_M) = x^T
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:  # .to(xt.dtype): FP8 tiles widened in registers (a no-op for bf16 W)
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            acc_g = tl.dot(tl.load(gate_ptrs, eviction_policy=EVICT).to(xt.dtype), xt, acc_g)
            if SILU_MUL:
                acc_u = tl.dot(tl.load(up_ptrs, eviction_policy=EVICT).to(xt.dtype), xt, acc_u)
        else:
            k_ok = offs_k < K - k0
            xt = tl.load(x_ptrs, mask=m_mask[None, :] & k_ok[:, None], other=0.0)
            w_mask = n_mask[:, None] & k_ok[None, :]
            acc_g = tl.dot(tl.load(gate_ptrs, mask=w_mask, other=0.0, eviction_policy=EVICT).to(xt.dtype),
                           xt, acc_g)
            if SILU_MUL:
                acc_u = tl.dot(tl.load(up_ptrs, mask=w_mask, other=0.0, eviction_policy=EVICT).to(xt.dtype),
                               xt, acc_u)
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    pdl_launch_dependents(PDL)  # W is read: the next kernel may launch
    if W_SCALE:  # FP8 rows' scales (up rows' after the N gate rows)
        acc_g *= tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        if SILU_MUL:
            acc_u *= tl.load(w_scale_ptr + N + offs_n, mask=n_mask, other=0.0)[:, None]
    if RMS_SCALE:
        inv_rms = _inv_rms(sum_sq_ptr, offs_m, m_mask, num_sums, K, eps, BLOCK_S)
        acc_g *= inv_rms[None, :]
        acc_u *= inv_rms[None, :]
    _epilogue(acc_g, acc_u, bias_ptr, out_ptr, residual_ptr, sum_sq_ptr, offs_n, offs_m, n_mask,
              m_mask, stride_om, stride_rm, num_sums, HAS_BIAS, SILU_MUL, ADD_RESIDUAL)


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_wn,
                     residual_ptr, sum_sq_ptr, num_sums, eps, w_scale_ptr,
                     HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                     ADD_RESIDUAL: tl.constexpr, RMS_SCALE: tl.constexpr, BLOCK_S: tl.constexpr,
                     W_SCALE: tl.constexpr):
    # M = 1: fp32 products accumulate per (n, k) lane; the K reduction runs once, at the end.
    # ADD_RESIDUAL / RMS_SCALE: as in _gemv_dot_kernel.
    pdl_wait(PDL)  # before any global access (pdl.py)
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    gate_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # (BLOCK_N, BLOCK_K)
    up_ptrs = gate_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            x = tl.load(x_ptr + k0 + offs_k).to(tl.float32)[None, :]
            acc_g += tl.load(gate_ptrs, eviction_policy=EVICT).to(tl.float32) * x
            if SILU_MUL:
                acc_u += tl.load(up_ptrs, eviction_policy=EVICT).to(tl.float32) * x
        else:
            k_ok = offs_k < K - k0
            x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            w_mask = n_mask[:, None] & k_ok[None, :]
            acc_g += tl.load(gate_ptrs, mask=w_mask, other=0.0, eviction_policy=EVICT).to(tl.float32) * x
            if SILU_MUL:
                acc_u += tl.load(up_ptrs, mask=w_mask, other=0.0, eviction_policy=EVICT).to(tl.float32) * x
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    pdl_launch_dependents(PDL)  # W is read: the next kernel may launch
    offs_m = tl.arange(0, 1)
    gate, up = tl.sum(acc_g, axis=1)[:, None], tl.sum(acc_u, axis=1)[:, None]  # (BLOCK_N, 1)
    if W_SCALE:
        gate *= tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        if SILU_MUL:
            up *= tl.load(w_scale_ptr + N + offs_n, mask=n_mask, other=0.0)[:, None]
    if RMS_SCALE:
        inv_rms = _inv_rms(sum_sq_ptr, offs_m, offs_m < 1, num_sums, K, eps, BLOCK_S)
        gate *= inv_rms[None, :]
        up *= inv_rms[None, :]
    _epilogue(gate, up, bias_ptr, out_ptr, residual_ptr, sum_sq_ptr, offs_n, offs_m, n_mask,
              offs_m < 1, 0, 0, num_sums, HAS_BIAS, SILU_MUL, ADD_RESIDUAL)


def _launch(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None, n_out: int,
            config: GemvConfig | None, silu_mul: bool, residual: torch.Tensor | None = None,
            rms: RowRms | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, sum_sq): sum_sq (M, programs) fp32 with a residual (the producer), else None."""
    m, k = x.shape
    assert 1 <= m <= MAX_ROWS, f"gemv serves 1..{MAX_ROWS} rows, got {m}"
    w_scale = None
    if isinstance(weight, Fp8Weight):
        config = config or measured_config(m, weight, fused=silu_mul)
        weight, w_scale = weight.weight, weight.scale
    assert weight.shape[1] == k and (x.dtype == weight.dtype or w_scale is not None)
    assert x.stride(1) == 1 and weight.stride(1) == 1 and (bias is None or bias.is_contiguous())
    assert residual is None or rms is None, "a GEMM either produces a RowRms or consumes one"
    cfg = (config or measured_config(m, weight, fused=silu_mul)
           or candidate_configs(m, n_out, k, fused=silu_mul)[0])
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n_out, cfg.block_n),)
    sum_sq = None
    if residual is not None:
        assert residual.shape == out.shape and residual.dtype == out.dtype and residual.stride(1) == 1
        assert grid[0] <= MAX_SUMS, f"{grid[0]} programs: more partial sums than a consumer loads"
        sum_sq = torch.empty(m, grid[0], dtype=torch.float32, device=x.device)
    if rms is not None:
        assert rms.sum_sq.shape[0] == m and rms.sum_sq.is_contiguous()
        sum_sq = rms.sum_sq
    num_sums = 0 if sum_sq is None else sum_sq.shape[1]
    flags = dict(HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
                 EVEN=n_out % cfg.block_n == 0 and k % cfg.block_k == 0,
                 BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 ADD_RESIDUAL=residual is not None, RMS_SCALE=rms is not None,
                 BLOCK_S=triton.next_power_of_2(num_sums) if rms is not None else 1, W_SCALE=w_scale is not None,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x))
    # pointers the flags leave unread: any tensor of the launch
    bias_arg = bias if bias is not None else weight
    residual_arg = residual if residual is not None else out
    sum_sq_arg = sum_sq if sum_sq is not None else out
    eps = rms.eps if rms is not None else 0.0
    w_scale_arg = w_scale if w_scale is not None else out
    if cfg.use_dot:
        _gemv_dot_kernel[grid](x, weight, bias_arg, out, m, n_out, k, x.stride(0),
                               weight.stride(0), out.stride(0), residual_arg, sum_sq_arg,
                               residual_arg.stride(0), num_sums, eps, w_scale_arg, BLOCK_M=16, **flags)
    else:
        assert m == 1, "the row kernel serves M = 1 only"
        _gemv_row_kernel[grid](x, weight, bias_arg, out, n_out, k, weight.stride(0),
                               residual_arg, sum_sq_arg, num_sums, eps, w_scale_arg, **flags)
    return out, sum_sq if residual is not None else None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, rms: RowRms | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (M, K), M <= 16: (M, N) in x's dtype, fp32 accumulation.
    config: default the MEASURED winner, else the first candidate. rms (a folded RMSNorm's
    consumer): x is the raw residual stream h with its `RowRms`, weight = W * norm weight
    (folded at load): returns F.linear(rmsnorm(h) * norm weight, W, bias) up to bf16 rounding,
    as (h @ weight^T) * rsqrt(mean(h^2) + eps) + bias. Graph safe: one launch, one output
    allocation, no host reads."""
    return _launch(x, weight, bias, weight.shape[0], config, silu_mul=False, rms=rms)[0]


def gemv_gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, config: GemvConfig | None = None,
                      rms: RowRms | None = None) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for gate_up = [gate; up] (2I, K): (M, I), rounded as
    `silu_mul(F.linear(x, gate_up))` rounds (gate and up to x's dtype first). rms: as `gemv`'s,
    both accumulators scaled before the rounding."""
    assert gate_up.shape[0] % 2 == 0
    return _launch(x, gate_up, None, gate_up.shape[0] // 2, config, silu_mul=True, rms=rms)[0]


def gemv_add_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor, eps: float,
                      config: GemvConfig | None = None) -> tuple[torch.Tensor, RowRms]:
    """A folded RMSNorm's producer: (h, h's RowRms) for h = residual + F.linear(x, weight, bias),
    rounded as add_rmsnorm rounds it (the GEMM's output to x's dtype, then the sum). Out of
    place: residual is not written. eps: the norm's, for the consumer."""
    h, sum_sq = _launch(x, weight, bias, weight.shape[0], config, silu_mul=False, residual=residual)
    return h, RowRms(sum_sq, eps)
