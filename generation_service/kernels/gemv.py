"""Skinny GEMMs for decode (Triton): y (M, N) = x (M, K) @ W^T (+ bias), W (N, K) row-major
(the nn.Linear layout), M <= 16 rows, fp32 accumulation, output in x's dtype.

Why: at M = 1..8 every projection of a decode step is a GEMV, bound by reading W once
(docs/gpu.md: the 8B projections + LM head alone ran at 3.67-3.76 TB/s under cuBLAS, ~88% of
the 4.2 TB/s copy bandwidth). Design for bandwidth:
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

Configs: no autotuning (autotune would sync and time inside a graph capture). `candidate_configs`
gives 2-4 configs per shape (a first guess, then alternatives); benchmarks/kernels.py
(`--only gemv`) times every candidate against cuBLAS. The H200 run showed the first guesses
mostly losing and cuBLAS winning some shapes outright (qkv, down), so the choice is measured:
`MEASURED` maps (weight shape, rows) to the winning config or to cuBLAS, and `linear` /
`gate_up_silu` dispatch on it. Unmeasured shapes (other models, other dtypes, M > 8) run cuBLAS.
NOTE: the winners run fewer, larger programs than the "2 programs per SM" rule above suggests
(8B o_proj: BLOCK_N 32 = 128 programs), so that rule is a starting point, not a law.
Used by `engine/decode_forward.py` for buckets <= `gemv_max_batch`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

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

# From benchmarks/results/kernels-gemv-h200.json (commit 39e64ce: `kernels.py --only
# gemv,gemv_decode` on one H200, bf16, each projection a CUDA graph of one launch per layer over
# distinct weights; gate_up is the fused gemv_gate_up_silu vs F.linear + silu_mul).
# (weight rows, K, fused) -> ((max rows, choice), ...) by ascending max rows; rows measured:
# 1, 2, 4, 8. choice: the fastest Triton config where it beat cuBLAS by MIN_GAIN at every measured
# row count of the range, else CUBLAS. Comments: us per call, cuBLAS -> that config (or the best
# Triton config where cuBLAS won). tests/unit/kernels/test_gemv_kernel.py re-derives this from
# the JSON: a new run means a new table.
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
# Triton kernels overlap across them. benchmarks/results/profile-h200-triton-m1.json (same run,
# 1-row step, PDL on): 8B 4.463 -> 4.427 ms, 1B 1.021 -> 1.014 ms. Configs: each shape's fastest
# Triton config at M = 1 in kernels-gemv-h200.json.
PDL_M1: dict[tuple[int, int, bool], GemvConfig] = {
    (6144, 4096, False): GemvConfig(16, 512, num_stages=3, use_dot=False),  # 8B qkv 15.75 us
    (4096, 14336, False): GemvConfig(32, 256),  # 8B down 33.06 us
    (3072, 2048, False): GemvConfig(16, 512, num_stages=3, use_dot=False),  # 1B qkv 7.06 us
    (2048, 8192, False): GemvConfig(16, 512, num_stages=3),  # 1B down 14.55 us
}


def measured_config(m: int, weight: torch.Tensor, *, fused: bool = False,
                    pdl: bool | None = None) -> GemvConfig | None:
    """The Triton config that beat cuBLAS on the H200 for x (m, K) @ weight^T (fused: weight is
    [gate; up] for gemv_gate_up_silu), or None (CUBLAS): cuBLAS won, or nobody measured it.
    pdl (default: whether this weight's kernels launch with PDL, `kernels.pdl.pdl_on`): one row
    also takes PDL_M1's choices."""
    if weight.dtype != torch.bfloat16:  # the table's numbers are bf16 only
        return CUBLAS
    key = (weight.shape[0], weight.shape[1], fused)
    if m == 1 and key in PDL_M1 and (pdl_on(weight) if pdl is None else pdl):
        return PDL_M1[key]
    return next((choice for max_m, choice in MEASURED.get(key, ()) if m <= max_m), CUBLAS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) by whichever of cuBLAS and `gemv` MEASURED says is faster here."""
    config = measured_config(x.shape[0], weight)
    if config is CUBLAS:
        return F.linear(x, weight, bias)
    return gemv(x, weight, bias, config=config)


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul(F.linear(x, gate_up)), or the fused `gemv_gate_up_silu` where MEASURED says it is
    faster (its timing already includes the silu_mul launch it saves)."""
    config = measured_config(x.shape[0], gate_up, fused=True)
    if config is CUBLAS:
        return silu_mul(F.linear(x, gate_up))
    return gemv_gate_up_silu(x, gate_up, config=config)


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
def _epilogue(acc_g, acc_u, bias_ptr, out_ptr, offs_n, offs_m, n_mask, m_mask, stride_om,
              HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr):
    """acc_g/acc_u (BLOCK_N, BLOCK_M) fp32 -> out[m, n] (+ bias[n]; silu(gate) * up)."""
    dt = out_ptr.dtype.element_ty
    out = acc_g
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if SILU_MUL:
        g = out.to(dt).to(tl.float32)  # gate and up rounded as the GEMM's bf16 output would be
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu, rounded
        out = act * acc_u.to(dt).to(tl.float32)
    ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]  # (BLOCK_N, BLOCK_M)
    tl.store(ptrs, out.to(dt), mask=m_mask[None, :] & n_mask[:, None])


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                     HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr):
    # swap-AB: W's tile is the MMA's A operand (K-major as stored), x^T its B operand;
    # rows of x beyond M load as zeros. EVEN: N % BLOCK_N == 0 and K % BLOCK_K == 0.
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
        if EVEN:
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            acc_g = tl.dot(tl.load(gate_ptrs, eviction_policy=EVICT), xt, acc_g)
            if SILU_MUL:
                acc_u = tl.dot(tl.load(up_ptrs, eviction_policy=EVICT), xt, acc_u)
        else:
            k_ok = offs_k < K - k0
            xt = tl.load(x_ptrs, mask=m_mask[None, :] & k_ok[:, None], other=0.0)
            w_mask = n_mask[:, None] & k_ok[None, :]
            acc_g = tl.dot(tl.load(gate_ptrs, mask=w_mask, other=0.0, eviction_policy=EVICT), xt, acc_g)
            if SILU_MUL:
                acc_u = tl.dot(tl.load(up_ptrs, mask=w_mask, other=0.0, eviction_policy=EVICT), xt, acc_u)
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    pdl_launch_dependents(PDL)  # W is read: the next kernel may launch
    _epilogue(acc_g, acc_u, bias_ptr, out_ptr, offs_n, offs_m, n_mask, m_mask, stride_om,
              HAS_BIAS, SILU_MUL)


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_wn,
                     HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # M = 1: fp32 products accumulate per (n, k) lane; the K reduction runs once, at the end.
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
    _epilogue(tl.sum(acc_g, axis=1)[:, None], tl.sum(acc_u, axis=1)[:, None], bias_ptr, out_ptr,
              offs_n, offs_m, n_mask, offs_m < 1, 0, HAS_BIAS, SILU_MUL)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_out: int,
            config: GemvConfig | None, silu_mul: bool) -> torch.Tensor:
    m, k = x.shape
    assert 1 <= m <= MAX_ROWS, f"gemv serves 1..{MAX_ROWS} rows, got {m}"
    assert weight.shape[1] == k and x.dtype == weight.dtype
    assert x.stride(1) == 1 and weight.stride(1) == 1 and (bias is None or bias.is_contiguous())
    cfg = (config or measured_config(m, weight, fused=silu_mul)
           or candidate_configs(m, n_out, k, fused=silu_mul)[0])
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    flags = dict(HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
                 EVEN=n_out % cfg.block_n == 0 and k % cfg.block_k == 0,
                 BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x))
    grid = (triton.cdiv(n_out, cfg.block_n),)
    bias_arg = bias if bias is not None else weight  # never read without HAS_BIAS
    if cfg.use_dot:
        _gemv_dot_kernel[grid](x, weight, bias_arg, out, m, n_out, k, x.stride(0),
                               weight.stride(0), out.stride(0), BLOCK_M=16, **flags)
    else:
        assert m == 1, "the row kernel serves M = 1 only"
        _gemv_row_kernel[grid](x, weight, bias_arg, out, n_out, k, weight.stride(0), **flags)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (M, K), M <= 16: (M, N) in x's dtype, fp32 accumulation.
    config: default the MEASURED winner, else the first candidate. Graph safe: one launch, one
    output allocation, no host reads."""
    return _launch(x, weight, bias, weight.shape[0], config, silu_mul=False)


def gemv_gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor,
                      config: GemvConfig | None = None) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for gate_up = [gate; up] (2I, K): (M, I), rounded as
    `silu_mul(F.linear(x, gate_up))` rounds (gate and up to x's dtype first)."""
    assert gate_up.shape[0] % 2 == 0
    return _launch(x, gate_up, None, gate_up.shape[0] // 2, config, silu_mul=True)
