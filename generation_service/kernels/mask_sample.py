"""Fused grammar-mask apply + sampling, one token per row.

Semantics (``sample_reference.mask_sample_torch`` implements the same, step by step):
1. x = logits as float32; NaN -> -inf.
2. Mask. Token t < mask_vocab_size is allowed iff bit t of the row's bitmask is set
   (word t // 32, bit t % 32). Tokens t >= mask_vocab_size (logits may be wider than the
   tokenizer vocab) are allowed only when the row is unconstrained, i.e. every bit below
   mask_vocab_size is set. Words past the mask vocab are ignored. Disallowed -> -inf.
3. logprob = log_softmax(x)[token] (temperature 1, after the mask).
4. temperature <= 0: token = argmax x (ties -> smallest id).
5. Otherwise s = x * (1 / temperature); keep s >= tau where tau combines
   top-k (keep iff fewer than k tokens are strictly larger; ties kept; off if k <= 0 or
   k >= vocab) and then top-p on the top-k-renormalised mass (keep iff the mass strictly
   larger is < top_p; off if top_p >= 1), as in HF/vLLM.
6. token = argmax over kept of s + g, g = -log(-log(u)), u = the Philox uniform of
   (seed, step, t) (philox.py): Gumbel-max, an exact sample of softmax(s) restricted to
   the kept set, whose randomness depends only on (seed, step, token id), never on the
   batch layout.
   For verifying deterministic drafts, sample each position with its own step and
   accept the draft iff it equals the sample: P(accept) = p(draft), and on rejection the
   sample is distributed as p without the draft, which is the speculative rule for q = 1.

Launches: ``_partial_kernel`` grid (R, num_splits) does steps 1-4 and the unfiltered
Gumbel argmax over a vocab slice; ``_finalize_kernel`` grid (R,) merges the slices and,
for rows with top-k/top-p, finds tau by a multi-probe search on the order-preserving int
key of s (11 passes over the row per filter with 8 probes; exact, no sort), then draws
once more. With ``mask_slot`` both read the row's mask words in place from a ring of
entries (the step channel's mapped masks, entry = the device scalar ``*mask_slot``) rather
than from rows gathered before the launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .philox import philox_uniform_block

_NEG_INF_KEY = tl.constexpr(-2139095041)  # _key(-inf)


@triton.jit
def _key(s):
    """float32 -> int32 key with the same order (negatives flip their magnitude bits)."""
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _is_unconstrained(mask_row, mask_vocab, BLOCK_W: tl.constexpr):
    """True iff every bit below mask_vocab is set (mask_row: the row's words)."""
    ok = tl.full([], 1, tl.int32)
    num_words = tl.cdiv(mask_vocab, 32)
    for w0 in range(0, num_words, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        word = tl.load(mask_row + w, mask=w < num_words, other=-1)
        nbits = tl.minimum(mask_vocab - w * 32, 32)  # valid bits in this word
        need = tl.where(nbits >= 32, -1, (1 << tl.minimum(nbits, 31)) - 1)
        ok = ok & tl.min(((word & need) == need).to(tl.int32), 0)
    return ok != 0


@triton.jit
def _mask_row(mask_ptr, mask_slot_ptr, row, stride_m, stride_slot, MASK_RING: tl.constexpr):
    """The row's mask words: mask_ptr + row * stride_m, in ring entry *mask_slot_ptr if MASK_RING."""
    row_m = row.to(tl.int64) * stride_m
    if MASK_RING:
        row_m += tl.load(mask_slot_ptr).to(tl.int64) * stride_slot
    return mask_ptr + row_m


@triton.jit
def _masked_logits(logits_ptr, mask_row, row_l, offs, vocab, mask_vocab,
                   unconstrained, HAS_MASK: tl.constexpr):
    x = tl.load(logits_ptr + row_l + offs, mask=offs < vocab, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    if HAS_MASK:
        in_mask = offs < mask_vocab
        word = tl.load(mask_row + offs // 32, mask=in_mask, other=0)
        bit = (word >> (offs % 32)) & 1
        allowed = tl.where(in_mask, bit != 0, unconstrained)
        x = tl.where(allowed, x, float("-inf"))
    return x


@triton.jit
def _gumbel(seed, step, t0, BLOCK: tl.constexpr):
    """Gumbel noise of tokens t0 .. t0 + BLOCK - 1."""
    u = philox_uniform_block(seed, step, t0, BLOCK)
    return -tl.log(-tl.log(u))


@triton.jit
def _partial_kernel(
    logits_ptr, mask_ptr, mask_slot_ptr, temp_ptr, seeds_ptr, steps_ptr, work_ptr,
    vocab, mask_vocab, stride_l, stride_m, stride_slot, split_len,
    HAS_MASK: tl.constexpr, MASK_RING: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_l = row.to(tl.int64) * stride_l
    mask_row = _mask_row(mask_ptr, mask_slot_ptr, row, stride_m, stride_slot, MASK_RING)
    start = split * split_len
    end = tl.minimum(start + split_len, vocab)
    unconstrained = tl.full([], 1, tl.int1)
    if HAS_MASK:
        if mask_vocab < end:  # only a slice with tokens past the mask vocab reads the whole row
            unconstrained = _is_unconstrained(mask_row, mask_vocab, BLOCK_W)
    temp = tl.load(temp_ptr + row)
    inv_t = 1.0 / tl.where(temp > 0, temp, 1.0)
    seed = tl.load(seeds_ptr + row)
    step = tl.load(steps_ptr + row)
    m1 = tl.full([], float("-inf"), tl.float32)
    z1 = tl.zeros([], tl.float32)
    best_x = tl.full([], float("-inf"), tl.float32)
    best_xi = tl.zeros([], tl.int32)
    best_g = tl.full([], float("-inf"), tl.float32)
    best_gi = tl.zeros([], tl.int32)
    for t0 in range(start, end, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        x = _masked_logits(logits_ptr, mask_row, row_l, offs, vocab, mask_vocab,
                           unconstrained, HAS_MASK)
        x = tl.where(offs < end, x, float("-inf"))
        bx, bi = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        m_new = tl.maximum(m1, bx)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        z1 = z1 * tl.exp(m1 - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
        m1 = m_new
        if bx > best_x:
            best_x = bx
            best_xi = t0 + bi
        if temp > 0:
            score = x * inv_t + _gumbel(seed, step, t0, BLOCK)
            bg, bgi = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
            if bg > best_g:
                best_g = bg
                best_gi = t0 + bgi
    # work row layout (fp32): [m1, z1, best_x, best_xi, best_g, best_gi] per split
    w = work_ptr + (row * NUM_SPLITS + split) * 6
    tl.store(w + 0, m1)
    tl.store(w + 1, z1)
    tl.store(w + 2, best_x)
    tl.store(w + 3, best_xi.to(tl.float32))
    tl.store(w + 4, best_g)
    tl.store(w + 5, best_gi.to(tl.float32))


@triton.jit
def _pass_stats(logits_ptr, mask_row, row_l, vocab, mask_vocab, unconstrained,
                inv_t, s_max, probes, NEED_MASS: tl.constexpr, HAS_MASK: tl.constexpr,
                BLOCK: tl.constexpr, PROBES: tl.constexpr):
    """One pass over the row: for each probe key u, the count and the mass
    (sum of exp(s - s_max)) of the tokens whose key is >= u."""
    counts = tl.zeros([PROBES], tl.int32)
    masses = tl.zeros([PROBES], tl.float32)
    probes32 = probes.to(tl.int32)  # keys and probes all lie in int32
    for t0 in range(0, vocab, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        s = _masked_logits(logits_ptr, mask_row, row_l, offs, vocab, mask_vocab,
                           unconstrained, HAS_MASK) * inv_t
        hit = (_key(s)[:, None] >= probes32[None, :]) & (offs < vocab)[:, None]  # (BLOCK, P)
        counts += tl.sum(hit.to(tl.int32), 0)
        if NEED_MASS:
            masses += tl.sum(tl.where(hit, tl.exp(s - s_max)[:, None], 0.0), 0)
    return counts, masses


@triton.jit
def _finalize_kernel(
    logits_ptr, mask_ptr, mask_slot_ptr, temp_ptr, top_k_ptr, top_p_ptr, seeds_ptr, steps_ptr,
    work_ptr, out_ids_ptr, out_logprobs_ptr,
    vocab, mask_vocab, stride_l, stride_m, stride_slot,
    HAS_MASK: tl.constexpr, MASK_RING: tl.constexpr, ENABLE_FILTERS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
    PROBES: tl.constexpr,
):
    row = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    w = work_ptr + (row * NUM_SPLITS + offs_s) * 6
    m1s = tl.load(w + 0, mask=s_mask, other=float("-inf"))
    z1s = tl.load(w + 1, mask=s_mask, other=0.0)
    m1 = tl.max(m1s, 0)
    m_safe = tl.where(m1 == float("-inf"), 0.0, m1)
    z1 = tl.sum(z1s * tl.exp(m1s - m_safe), 0)
    # Splits are in vocab order, so the first split holding the max has the smallest id.
    bx, bxs = tl.max(tl.load(w + 2, mask=s_mask, other=float("-inf")), 0,
                     return_indices=True, return_indices_tie_break_left=True)
    greedy_id = tl.load(work_ptr + (row * NUM_SPLITS + bxs) * 6 + 3).to(tl.int32)
    bg, bgs = tl.max(tl.load(w + 4, mask=s_mask, other=float("-inf")), 0,
                     return_indices=True, return_indices_tie_break_left=True)
    sample_id = tl.load(work_ptr + (row * NUM_SPLITS + bgs) * 6 + 5).to(tl.int32)

    temp = tl.load(temp_ptr + row)
    token = tl.where(temp > 0, sample_id, greedy_id)
    if ENABLE_FILTERS:
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        use_k = (top_k > 0) & (top_k < vocab)
        use_p = top_p < 1.0
        if (temp > 0) & (use_k | use_p) & (m1 > float("-inf")):
            token = _filtered_sample(
                logits_ptr, _mask_row(mask_ptr, mask_slot_ptr, row, stride_m, stride_slot, MASK_RING),
                row, vocab, mask_vocab, stride_l, temp,
                top_k, top_p, use_k, use_p, m1, tl.load(seeds_ptr + row),
                tl.load(steps_ptr + row), HAS_MASK, BLOCK, BLOCK_W, PROBES)
    tl.store(out_ids_ptr + row, token)
    x_tok = tl.load(logits_ptr + row.to(tl.int64) * stride_l + token).to(tl.float32)
    x_tok = tl.where(x_tok != x_tok, float("-inf"), x_tok)
    tl.store(out_logprobs_ptr + row, x_tok - m1 - tl.log(z1))


@triton.jit
def _filtered_sample(logits_ptr, mask_row, row, vocab, mask_vocab, stride_l,
                     temp, top_k, top_p, use_k, use_p, m1, seed, step,
                     HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
                     PROBES: tl.constexpr):
    """The top-k/top-p draw of one row (mask_row: its mask words)."""
    row_l = row.to(tl.int64) * stride_l
    unconstrained = tl.full([], 1, tl.int1)
    if HAS_MASK:
        if mask_vocab < vocab:
            unconstrained = _is_unconstrained(mask_row, mask_vocab, BLOCK_W)
    inv_t = 1.0 / temp
    s_max = m1 * inv_t
    top_key = _key(s_max).to(tl.int64) + 1  # no token has a key >= top_key
    # Both searches keep pred(lo) true, pred(hi) false for a predicate that falls as the
    # key rises, and probe PROBES evenly spaced keys strictly inside (lo, hi) per pass:
    # ceil(32 / log2(PROBES + 1)) passes (11 for 8 probes) instead of 32 for bisection.
    j = tl.arange(0, PROBES).to(tl.int64)
    # top-k: tau_k = largest key with count(key >= tau_k) >= k (the k-th largest key).
    tau = tl.full([], _NEG_INF_KEY, tl.int64)
    if use_k:
        lo = tau
        hi = top_key
        while hi - lo > 1:
            probes = lo + ((j + 1) * (hi - lo)) // (PROBES + 1)
            counts, _ = _pass_stats(logits_ptr, mask_row, row_l, vocab, mask_vocab,
                                    unconstrained, inv_t, s_max, probes, False, HAS_MASK,
                                    BLOCK, PROBES)
            ok = counts >= top_k
            lo = tl.max(tl.where(ok, probes, lo), 0)
            hi = tl.min(tl.where(ok, hi, probes), 0)
        tau = lo
    # top-p: G(u) = mass of key >= u; keep key >= u* - 1 for the least u* with G(u*) < P.
    if use_p:
        _, z_k = _pass_stats(logits_ptr, mask_row, row_l, vocab, mask_vocab,
                             unconstrained, inv_t, s_max, tau + j * 0, True, HAS_MASK,
                             BLOCK, PROBES)
        p_mass = tl.maximum(top_p * tl.max(z_k, 0), 1e-30)
        lo = tau
        hi = top_key
        while hi - lo > 1:
            probes = lo + ((j + 1) * (hi - lo)) // (PROBES + 1)
            _, masses = _pass_stats(logits_ptr, mask_row, row_l, vocab, mask_vocab,
                                    unconstrained, inv_t, s_max, probes, True, HAS_MASK,
                                    BLOCK, PROBES)
            ok = masses >= p_mass
            lo = tl.max(tl.where(ok, probes, lo), 0)
            hi = tl.min(tl.where(ok, hi, probes), 0)
        tau = hi - 1
    best_g = tl.full([], float("-inf"), tl.float32)
    best_gi = tl.zeros([], tl.int32)
    for t0 in range(0, vocab, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        s = _masked_logits(logits_ptr, mask_row, row_l, offs, vocab, mask_vocab,
                           unconstrained, HAS_MASK) * inv_t
        keep = (_key(s).to(tl.int64) >= tau) & (offs < vocab)
        score = tl.where(keep, s + _gumbel(seed, step, t0, BLOCK), float("-inf"))
        bg, bgi = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
        if bg > best_g:
            best_g = bg
            best_gi = t0 + bgi
    return best_gi.to(tl.int32)


def default_num_splits(num_rows: int, vocab: int, device: torch.device, block: int) -> int:
    """Vocab slices per row: about two programs per SM, at least 8 blocks per slice."""
    num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 132)
    want = triton.cdiv(2 * num_sms, max(1, num_rows))
    return max(1, min(want, triton.cdiv(vocab, 8 * block), 64))


def mask_sample(logits: torch.Tensor, bitmask: torch.Tensor | None, temperature: torch.Tensor,
                top_k: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
                steps: torch.Tensor, mask_vocab_size: int | None = None,
                enable_filters: bool = True, num_splits: int | None = None,
                search_probes: int = 8, out_ids: torch.Tensor | None = None,
                out_logprobs: torch.Tensor | None = None,
                mask_slot: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (R, V) fp32/bf16/fp16, bitmask (R, W) int32 or None -> (ids (R,) int32,
    logprobs (R,) fp32). temperature/top_p (R,) fp32, top_k (R,) int32, seeds/steps (R,)
    int64. enable_filters=False compiles out top-k/top-p (a graph variant for batches
    that use neither). search_probes (a power of 2) trades passes over a filtered row
    for compares per token. Graph safe: no host reads of device values.
    mask_slot (1,) int64 on the device: bitmask is a ring (D, >= R, W) (any entry and row
    strides, e.g. the step channel's mapped masks) and row r's mask is
    bitmask[mask_slot[0], r], read in place (no gather).
    """
    num_rows, vocab = logits.shape
    assert logits.stride(1) == 1
    assert temperature.dtype == top_p.dtype == torch.float32 and top_k.dtype == torch.int32
    assert seeds.dtype == steps.dtype == torch.int64
    has_mask = bitmask is not None
    ring = mask_slot is not None
    if ring:
        assert has_mask and bitmask.dim() == 3 and bitmask.shape[1] >= num_rows
        assert mask_slot.dtype == torch.int64 and mask_slot.numel() == 1
        slot_stride = bitmask.stride(0)
        bitmask = bitmask[0]  # (>= R, W) rows of entry 0; the kernels add slot * slot_stride
    else:
        mask_slot, slot_stride = logits, 0  # never read without MASK_RING
    if has_mask:
        assert bitmask.dtype == torch.int32 and bitmask.stride(1) == 1
        max_bits = bitmask.shape[1] * 32
        mask_vocab_size = min(max_bits if mask_vocab_size is None else mask_vocab_size,
                              max_bits)
    else:
        mask_vocab_size = vocab
    if out_ids is None:
        out_ids = torch.empty(num_rows, dtype=torch.int32, device=logits.device)
    if out_logprobs is None:
        out_logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out_ids, out_logprobs
    block = 1024
    if num_splits is None:
        num_splits = default_num_splits(num_rows, vocab, logits.device, block)
    split_len = triton.cdiv(triton.cdiv(vocab, num_splits), block) * block
    work = torch.empty(num_rows, num_splits, 6, dtype=torch.float32, device=logits.device)
    mask_arg = bitmask if has_mask else logits  # never read when HAS_MASK is False
    stride_m = bitmask.stride(0) if has_mask else 0
    _partial_kernel[(num_rows, num_splits)](
        logits, mask_arg, mask_slot, temperature, seeds, steps, work,
        vocab, mask_vocab_size, logits.stride(0), stride_m, slot_stride, split_len,
        HAS_MASK=has_mask, MASK_RING=ring, NUM_SPLITS=num_splits, BLOCK=block, BLOCK_W=1024,
        num_warps=4)
    _finalize_kernel[(num_rows,)](
        logits, mask_arg, mask_slot, temperature, top_k, top_p, seeds, steps, work,
        out_ids, out_logprobs, vocab, mask_vocab_size, logits.stride(0), stride_m, slot_stride,
        HAS_MASK=has_mask, MASK_RING=ring, ENABLE_FILTERS=enable_filters, NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK=block, BLOCK_W=1024,
        PROBES=search_probes, num_warps=8 if enable_filters else 4)  # one program per row
    return out_ids, out_logprobs
