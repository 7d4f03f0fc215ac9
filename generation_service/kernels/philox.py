"""Counter-based uniforms shared by the sampler kernel and its torch reference.

Philox4x32-10 keyed by the request's 64-bit seed, counter (token // 4, step lo, step hi,
0); its four outputs serve tokens 4c .. 4c + 3 (one Philox per four tokens: the sampler
is ALU-bound on it otherwise). A request's random number for token t at step s depends
only on (seed, s, t): never on its row, the batch it shares, or the launch shape.
Written out here (not ``tl.philox``) so the Triton and torch versions are provably the
same function on every Triton release. The uniform keeps the top 24 bits:
u = (x >> 8) * 2**-24, exact in float32, in [0, 1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_MASK32 = 0xFFFFFFFF


@triton.jit
def _to_uniform(x):
    return (x >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def philox_uniform_block(seed, step, t0, BLOCK: tl.constexpr):
    """Uniforms of tokens t0 .. t0 + BLOCK - 1 (t0 a multiple of 4) as a (BLOCK,) block.

    seed, step: int64 scalars.
    """
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = (t0 // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)
    zero = c0 * 0
    c1 = zero + (step & 0xFFFFFFFF).to(tl.uint32)
    c2 = zero + ((step >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c3 = zero
    for _ in tl.static_range(10):
        a = c0
        b = c2
        c0 = tl.umulhi(b, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(a, 0xD2511F53) ^ c3 ^ k1
        c1 = b * 0xCD9E8D57
        c3 = a * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    # Interleave so token 4c + j gets output j: join adds a minor dim, (BLOCK/4, 2, 2).
    u = tl.join(tl.join(_to_uniform(c0), _to_uniform(c2)),
                tl.join(_to_uniform(c1), _to_uniform(c3)))
    return tl.reshape(u, [BLOCK])


def _mul32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a < 2**32 (int64 tensor), b a 32-bit constant.

    Split b in 16-bit halves so no int64 product overflows.
    """
    p_lo = a * (b & 0xFFFF)  # < 2**48
    p_hi = a * (b >> 16)  # < 2**48
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = ((p_hi << 16) + p_lo) & _MASK32
    return hi & _MASK32, lo


def philox_uniform_torch(seed, step, tokens: torch.Tensor) -> torch.Tensor:
    """The same uniforms as ``philox_uniform_block``: ints -> (V,), (R,) tensors -> (R, V)."""
    seed = torch.as_tensor(seed, dtype=torch.int64, device=tokens.device)[..., None]
    step = torch.as_tensor(step, dtype=torch.int64, device=tokens.device)[..., None]
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    tokens = tokens.to(torch.int64)
    c0 = (tokens // 4) & _MASK32
    c1 = (step & _MASK32).expand(*step.shape[:-1], c0.shape[0])
    c2 = ((step >> 32) & _MASK32).expand_as(c1)
    c0 = c0.expand_as(c1)
    c3 = torch.zeros_like(c1)
    for _ in range(10):
        hi_b, lo_b = _mul32(c2, _ROUND_B)
        hi_a, lo_a = _mul32(c0, _ROUND_A)
        c0, c2 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1
        c1, c3 = lo_b, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    out = torch.stack([c0, c1, c2, c3], dim=-1)  # (..., V, 4)
    x = out.gather(-1, (tokens % 4).expand_as(c0)[..., None]).squeeze(-1)
    return (x >> 8).to(torch.float32) * 2.0 ** -24


@triton.jit
def _uniform_kernel(seeds_ptr, steps_ptr, out_ptr, num_tokens, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK
    offs = t0 + tl.arange(0, BLOCK)
    u = philox_uniform_block(tl.load(seeds_ptr + row), tl.load(steps_ptr + row), t0, BLOCK)
    tl.store(out_ptr + row * num_tokens + offs, u, mask=offs < num_tokens)


def philox_uniform_rows(seeds: torch.Tensor, steps: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(R, num_tokens) uniforms from the Triton helper; tests compare it with the torch one."""
    out = torch.empty(seeds.shape[0], num_tokens, device=seeds.device, dtype=torch.float32)
    block = 1024
    _uniform_kernel[(seeds.shape[0], triton.cdiv(num_tokens, block))](
        seeds, steps, out, num_tokens, BLOCK=block)
    return out
