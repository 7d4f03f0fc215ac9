"""Torch reference for ``mask_sample``: the same semantics, the same uniforms.

Row by row and sort based where the kernel bisects, so it checks the kernel's
top-k/top-p thresholds by a different route; see mask_sample.py for the semantics.
"""
from __future__ import annotations

import torch

from .philox import philox_uniform_torch


def _key_torch(s: torch.Tensor) -> torch.Tensor:
    bits = s.contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)


def apply_mask_torch(logits: torch.Tensor, bitmask: torch.Tensor | None,
                     mask_vocab_size: int | None = None) -> torch.Tensor:
    """Steps 1-2: float32 logits with NaN and disallowed tokens at -inf."""
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    if bitmask is None:
        return x
    vocab = x.shape[1]
    max_bits = bitmask.shape[1] * 32
    mask_vocab = min(max_bits if mask_vocab_size is None else mask_vocab_size, max_bits)
    tok = torch.arange(max(vocab, mask_vocab), device=x.device)
    words = bitmask.long()[:, (tok // 32).clamp(max=bitmask.shape[1] - 1)]
    bits = ((words >> (tok % 32)) & 1).bool()  # (R, max(V, mask_vocab))
    unconstrained = bits[:, :mask_vocab].all(dim=1, keepdim=True)
    allowed = torch.where(tok < mask_vocab, bits, unconstrained)[:, :vocab]
    return x.masked_fill(~allowed, float("-inf"))


def _keep_threshold(s: torch.Tensor, top_k: int, top_p: float) -> int:
    """tau on the int key of one row's scaled logits s (see the module docstring)."""
    keys = _key_torch(s)
    tau = -2 ** 62
    if 0 < top_k < s.numel():
        tau = int(keys.sort(descending=True).values[top_k - 1])
    if top_p < 1.0:
        e = torch.exp(s.double() - s.max().double())
        z_k = float(e[keys >= tau].sum())
        asc, order = keys.sort()
        suffix = torch.cat([e[order].flip(0).cumsum(0).flip(0), e.new_zeros(1)])
        mass_above = suffix[torch.searchsorted(asc, keys + 1)]  # mass strictly larger
        keep = (keys >= tau) & (mass_above < top_p * z_k)
        tau = int(keys[keep].min())
    return tau


def mask_sample_torch(logits: torch.Tensor, bitmask: torch.Tensor | None,
                      temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      seeds: torch.Tensor, steps: torch.Tensor,
                      mask_vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the same semantics and the same uniforms, one row at a time."""
    x = apply_mask_torch(logits, bitmask, mask_vocab_size)
    logprobs_all = torch.log_softmax(x, dim=-1)
    ids = x.argmax(dim=-1)
    vocab = x.shape[1]
    tok = torch.arange(vocab, device=x.device)
    u = philox_uniform_torch(seeds.to(x.device), steps.to(x.device), tok)  # (R, V)
    gumbel = -torch.log(-torch.log(u))
    for r in range(x.shape[0]):
        temp = float(temperature[r])
        if temp <= 0 or not torch.isfinite(x[r].max()):
            continue
        inv_t = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temp, dtype=torch.float32)
        s = x[r] * inv_t.to(x.device)
        tau = _keep_threshold(s, int(top_k[r]), float(top_p[r]))
        score = s + gumbel[r]
        ids[r] = score.masked_fill(_key_torch(s) < tau, float("-inf")).argmax()
    logprobs = logprobs_all.gather(1, ids[:, None]).squeeze(1)
    return ids.to(torch.int32), logprobs
