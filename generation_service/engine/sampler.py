"""Sampler: logits of the sampling positions -> accepted tokens per row.

Order per position: NaN -> -inf, grammar mask (constrained rows only), the
logits processing of logit_processing.py (EOS hold, logit_bias, penalties, min_p; rows that
ask for it), then temperature, top-k, top-p; greedy rows take the argmax of the processed
logits. Logprobs are those of the grammar-masked model distribution, before the processing.
Rows with drafts are verified here with the rules in speculative.py, so plain decoding is
simply the k = 0 case of the same code.

Randomness: the token at generated index i of a request draws from its own
`torch.Generator` seeded with mix(seed, i). The result depends only on (seed, request,
index): not on the batch, on preemption, or on how many draws other rows made.

On a CUDA device (logits left there by the runner) one-position rows sample where the
decode graphs sample, with `kernels.mask_sample`: Philox keyed by (seed, position of the
row's last input token), so a seeded request draws the same noise whether a step ran as a
graph or eagerly (a neighbour's prefill, logprobs). Draft-verify rows stay on the CPU rules
above (see `SampleRow.can_sample_on_device`); the CPU device path is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from generation_service.engine.events import TokenLogprob
from generation_service.engine.logit_processing import LogitProcessing
from generation_service.engine.pinned import PinnedStaging
from generation_service.engine.sample_row import SampleRow
from generation_service.engine.speculative import accept_greedy, accept_rejection

_MASK64 = (1 << 64) - 1
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass
class SampleResult:
    token_ids: list[int]             # accepted drafts, then the model's own token
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.token_ids) - 1


def mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): decorrelated generator seeds for consecutive tokens."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32, bit j of word w allows token 32 w + j  ->  (R, vocab_size) bool.
    Tokens past 32 W (beyond the mask's vocabulary) are disallowed."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1                 # (R, W, 32)
    allowed = bits.reshape(bitmask.shape[0], -1).bool()               # (R, 32 W)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i]] := -inf where bitmask[i] disallows (the torch reference)."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Same contract through xgrammar's kernel (CPU C++, CUDA or Triton by device)."""
    import xgrammar

    width = bitmask.shape[1]
    if width * 32 < logits.shape[1]:  # tokens past the mask's vocabulary: disallowed
        logits[rows, width * 32:] = float("-inf")
    full = torch.full((logits.shape[0], width), -1, dtype=torch.int32, device=logits.device)
    full[rows] = bitmask.to(logits.device)
    xgrammar.apply_token_bitmask_inplace(logits, full, vocab_size=min(logits.shape[1], width * 32),
                                         indices=rows.tolist())


# Mask application backends by name (EngineConfig.mask_backend); same contract, same result.
MASK_BACKENDS = {"torch": apply_token_bitmask, "xgrammar": apply_token_bitmask_xgrammar}


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(L, V) logits with everything outside each row's top-k and top-p nucleus at -inf.
    top_k (L,) int, 0 = off; top_p (L,) float, 1 = off."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab).unsqueeze(0)                          # (1, V)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)             # (L, 1)
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)                          # keeps at least rank 0
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class SampleLaunch:
    """The samples of a step, maybe still being drawn on the device (`Sampler.launch`).
    `tokens`: one token per row on the logits' device (None when a row drew several or the
    CPU rules drew them on the device's behalf), what a chained step feeds back."""

    def __init__(self, results: list[SampleResult] | None, tokens: torch.Tensor | None,
                 host: torch.Tensor | None = None, ready: torch.cuda.Event | None = None) -> None:
        self._results, self.tokens, self._host, self._ready = results, tokens, host, ready

    def result(self) -> list[SampleResult]:
        """The samples (waits for the device's draw, if it is one)."""
        if self._results is None:
            self._ready.synchronize()
            self._results = [SampleResult([token]) for token in self._host.tolist()]
        return self._results


class Sampler:
    # pinned buffers the device's tokens are copied into: one per launch not yet read (a
    # chained step's and the one after it), and a spare
    NUM_HOST_TOKEN_BUFFERS = 3

    def __init__(self, mask_backend: str = "torch") -> None:
        if mask_backend not in MASK_BACKENDS:
            raise ValueError(f"unknown mask backend {mask_backend!r}; available: {sorted(MASK_BACKENDS)}")
        self.apply_mask = MASK_BACKENDS[mask_backend]
        self._staging: PinnedStaging | None = None  # made for the first CUDA logits
        self._host_tokens: list[torch.Tensor] = []
        self._next_host = 0

    def staging(self, device: torch.device) -> PinnedStaging:
        if self._staging is None:
            self._staging = PinnedStaging(device, slots=4)
        return self._staging

    def launch(self, logits: torch.Tensor, rows: list[SampleRow],
               bitmask: torch.Tensor | None = None) -> SampleLaunch:
        """`self(...)` without waiting for the device where it can: CUDA logits whose rows all
        draw one token there (no drafts, no top-n logprobs) come back as device tokens with a
        copy to the host under way; anything else is sampled now."""
        if logits.device.type == "cuda" and rows and all(
                row.can_sample_on_device and not row.params.num_logprobs for row in rows):
            return self._reading(sample_on_device_tensor(logits, rows, bitmask, self.staging(logits.device)).long())
        results = self(logits, rows, bitmask)
        tokens = None
        if logits.device.type != "cuda" and all(len(result.token_ids) == 1 for result in results):
            tokens = torch.tensor([result.token_ids[0] for result in results], dtype=torch.int64)
        return SampleLaunch(results, tokens)

    def launch_greedy(self, logits: torch.Tensor) -> SampleLaunch:
        """`launch` for (R, V) logits whose rows all take the argmax (sample_row.all_plain_greedy),
        with no work per row on the host: NaN counts as -inf and ties go to the smallest id, as in
        mask_sample's greedy draw and the CPU sampler's."""
        tokens = logits.masked_fill(logits.isnan(), float("-inf")).argmax(dim=-1)
        if logits.device.type != "cuda":
            return SampleLaunch([SampleResult([token]) for token in tokens.tolist()], tokens)
        return self._reading(tokens)

    def _reading(self, tokens: torch.Tensor) -> SampleLaunch:
        """The launch of (R,) int64 device tokens, their copy to a pinned host buffer under way."""
        host = self._host_buffer(len(tokens))
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return SampleLaunch(None, tokens, host, ready)

    def _host_buffer(self, num_rows: int) -> torch.Tensor:
        """A pinned buffer of `num_rows` tokens not holding a launch's tokens still to be read."""
        if not self._host_tokens or self._host_tokens[0].numel() < num_rows:
            size = max(num_rows, 256)
            self._host_tokens = [torch.empty(size, dtype=torch.int64, pin_memory=True)
                                 for _ in range(self.NUM_HOST_TOKEN_BUFFERS)]
        buffer = self._host_tokens[self._next_host]
        self._next_host = (self._next_host + 1) % len(self._host_tokens)
        return buffer[:num_rows]

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 bitmask: torch.Tensor | None = None) -> list[SampleResult]:
        """logits (L, V), L = sum of rows' num_positions; bitmask (L, W) int32 aligned with
        logits (rows of unconstrained requests are ignored). CPU logits: every row here;
        CUDA logits: `can_sample_on_device` rows there, the others' logits to the CPU."""
        if logits.device.type != "cuda":
            return self._sample_cpu(logits, rows, bitmask)
        starts = _starts(rows)
        results: list[SampleResult | None] = [None] * len(rows)
        for on_device in (True, False):
            picked = [i for i, row in enumerate(rows) if row.can_sample_on_device == on_device]
            if not picked:
                continue
            index = [starts[i] + p for i in picked for p in range(rows[i].num_positions)]
            if len(index) == logits.shape[0]:  # every row here (a mixed step's usual case): no gather
                part = logits
            else:
                part = logits[torch.tensor(index, device=logits.device)]
            sample = self._sample_one_position if on_device else self._sample_cpu
            masks = bitmask[index] if bitmask is not None else None
            for i, result in zip(picked, sample(part if on_device else part.cpu(),
                                                [rows[i] for i in picked], masks)):
                results[i] = result
        return results

    def _sample_one_position(self, logits: torch.Tensor, rows: list[SampleRow],
                             bitmask: torch.Tensor | None) -> list[SampleResult]:
        """(R, V) device logits of one-position rows: tokens from mask_sample. It returns
        only the token's logprob, so rows asking for top-n logprobs get them from their
        masked logits on the CPU, computed as `_sample_cpu` does (same token, same numbers)."""
        token_ids = sample_on_device(logits, rows, bitmask, self.staging(logits.device))
        want = [k for k, row in enumerate(rows) if row.params.num_logprobs]
        logprobs = {}
        if want:
            masked = self._masked(logits[torch.tensor(want, device=logits.device)].cpu(),
                                  [rows[k] for k in want], bitmask[want] if bitmask is not None else None)
            logprobs = {k: _logprobs(masked[j:j + 1], [token_ids[k]], rows[k]) for j, k in enumerate(want)}
        return [SampleResult([token], logprobs.get(k, [])) for k, token in enumerate(token_ids)]

    def _masked(self, logits: torch.Tensor, rows: list[SampleRow],
                bitmask: torch.Tensor | None) -> torch.Tensor:
        """CPU float32 logits with NaN and, on constrained rows, disallowed tokens at -inf."""
        logits = torch.nan_to_num(logits.float(), nan=float("-inf"))
        if bitmask is not None:
            starts = _starts(rows)
            constrained = [starts[i] + p for i, row in enumerate(rows) if row.is_constrained
                           for p in range(row.num_positions)]
            if constrained:
                index = torch.tensor(constrained, dtype=torch.int64)
                self.apply_mask(logits, bitmask[index], index)
        return logits

    def _sample_cpu(self, logits: torch.Tensor, rows: list[SampleRow],
                    bitmask: torch.Tensor | None) -> list[SampleResult]:
        logits = self._masked(logits, rows, bitmask)
        scores = logits
        processing = LogitProcessing.of(rows, logits.shape[1])
        if processing is not None:
            scores = logits.clone()  # logprobs stay those of the masked distribution
            processing.apply(scores)
        starts = _starts(rows)
        probs = self._probs(scores, rows, starts)
        targets = scores.argmax(dim=-1).tolist()
        results = []
        for i, row in enumerate(rows):
            span = slice(starts[i], starts[i] + row.num_positions)
            if row.params.is_greedy:
                token_ids = accept_greedy(targets[span], row.drafts)
            else:
                token_ids = self._sample_row(probs[span], row)
            results.append(SampleResult(token_ids, _logprobs(logits[span], token_ids, row)))
        return results

    def _probs(self, logits: torch.Tensor, rows: list[SampleRow], starts: list[int]) -> torch.Tensor | None:
        if all(row.params.is_greedy for row in rows):
            return None
        per_pos = [row.params for row in rows for _ in range(row.num_positions)]
        temperature = torch.tensor([p.temperature or 1.0 for p in per_pos]).unsqueeze(1)
        scaled = logits / temperature
        top_k = torch.tensor([p.top_k for p in per_pos])
        top_p = torch.tensor([p.top_p for p in per_pos])
        if bool((top_k > 0).any() or (top_p < 1).any()):
            scaled = top_k_top_p(scaled, top_k, top_p)
        return torch.softmax(scaled, dim=-1)

    @staticmethod
    def _sample_row(probs: torch.Tensor, row: SampleRow) -> list[int]:
        uniforms, noises = [], []
        for p in range(row.num_positions):
            gen = torch.Generator().manual_seed(mix_seed(row.seed, row.first_index + p))
            uniforms.append(float(torch.rand((), generator=gen)))
            noises.append(torch.empty(probs.shape[1]).exponential_(generator=gen))
        return accept_rejection(probs, row.drafts, uniforms, noises)


def device_seed(sample_seed: int) -> int:
    """The int64 seed of mask_sample's Philox (keyed by seed and token position): the low
    63 bits of the request's seed, wherever a row is sampled on the GPU."""
    return sample_seed & ((1 << 63) - 1)


def sample_on_device(logits: torch.Tensor, rows: list[SampleRow],
                     bitmask: torch.Tensor | None, staging: PinnedStaging | None = None) -> list[int]:
    """`sample_on_device_tensor`, read back (a device sync)."""
    return sample_on_device_tensor(logits, rows, bitmask, staging).tolist()


def sample_on_device_tensor(logits: torch.Tensor, rows: list[SampleRow], bitmask: torch.Tensor | None,
                            staging: PinnedStaging | None = None) -> torch.Tensor:
    """One token per row with `kernels.mask_sample`, as `GpuDecodeRunner._sample` draws it:
    seed = device_seed(sample_seed), Philox step = the row's position, mask words with
    mask_vocab_size = the logits' width; greedy at temperature 0; top-k/top-p kept only when
    some row uses them (the graphs' `+filters` variants; off, they change no draw).
    logits (R, V) on the device, one row per SampleRow; bitmask (R, W) int32 (read on
    constrained rows only). Rows with logits processing: the mask and the processing in
    torch first (logit_processing.py, the CPU sampler's code), then mask_sample unmasked.
    Returns the (R,) int64 tokens on the device, without waiting for them: the host's inputs
    go through pinned `staging` (a pageable copy would wait for the stream)."""
    from generation_service.kernels.mask_sample import mask_sample

    device = logits.device
    staging = staging or PinnedStaging(device)
    x = logits.contiguous()
    masks = None
    if bitmask is not None and any(row.is_constrained for row in rows):
        # (a step in stream order gathered its masks on the device already: stream_channel.py)
        words = bitmask if bitmask.device == device else staging.tensor(torch.int32, bitmask.numpy())
        allowed = staging.tensor(torch.int32, [0 if row.is_constrained else -1 for row in rows])
        masks = words | allowed.unsqueeze(1)  # -1: every token allowed
    processing = LogitProcessing.of(rows, x.shape[1], device)
    if processing is not None:
        from generation_service.kernels.sample_reference import apply_mask_torch
        scores = apply_mask_torch(x, masks, x.shape[1])
        processing.apply(scores)
        # back in the logits' dtype: mask_sample's kernels compiled for it at start are reused
        x, masks = scores.to(x.dtype), None
    params = [row.params for row in rows]
    ints, floats = staging.upload(torch.int64, [np.array(
        [[device_seed(row.seed) for row in rows], [row.position for row in rows], [p.top_k for p in params]],
        dtype=np.int64)])[0], staging.upload(torch.float32, [np.array(
            [[p.temperature for p in params], [p.top_p for p in params]], dtype=np.float32)])[0]
    ints, floats = ints.view(3, len(rows)), floats.view(2, len(rows))
    ids, _ = mask_sample(
        x, masks, floats[0], ints[2].int(), floats[1], ints[0], ints[1],
        mask_vocab_size=x.shape[1] if masks is not None else None,
        enable_filters=any(row.params.uses_filters for row in rows), num_splits=eager_num_splits(x))
    return ids


def eager_num_splits(logits: torch.Tensor) -> int:
    """mask_sample's vocab slices for rows sampled outside the graphs: one value whatever the row
    count. NOTE: the slices are a compile-time constant of its kernels, and the default (by rows)
    takes a dozen values between 1 and 256 rows: each new one compiled mid-serving, for seconds.
    The draw does not depend on them (exact max over slices of per-token noise)."""
    from generation_service.kernels.mask_sample import default_num_splits
    return default_num_splits(1, logits.shape[1], logits.device, 1024)


def warm_device_sampler(vocab_size: int, device: torch.device) -> None:
    """Compile `sample_on_device`'s kernels (unmasked and masked rows) before serving."""
    from generation_service.kernels.mask_sample import mask_sample
    logits = torch.zeros(2, vocab_size, dtype=torch.bfloat16, device=device)
    masks = torch.full((2, -(-vocab_size // 32)), -1, dtype=torch.int32, device=device)
    floats, ints = torch.zeros(2, dtype=torch.float32, device=device), torch.zeros(2, dtype=torch.int64, device=device)
    for bitmask in (None, masks):
        mask_sample(logits, bitmask, floats, ints.int(), floats + 1, ints, ints,
                    mask_vocab_size=vocab_size if bitmask is not None else None, enable_filters=False,
                    num_splits=eager_num_splits(logits))


def _starts(rows: list[SampleRow]) -> list[int]:
    starts, offset = [], 0
    for row in rows:
        starts.append(offset)
        offset += row.num_positions
    return starts


def _logprobs(logits: torch.Tensor, token_ids: list[int], row: SampleRow) -> list[TokenLogprob]:
    """Log-probabilities under the masked model distribution (before temperature/top-k/p)."""
    n = row.params.num_logprobs
    if n == 0:
        return []
    logp = torch.log_softmax(logits[:len(token_ids)], dim=-1)
    top_values, top_ids = logp.topk(n, dim=-1)
    return [TokenLogprob(tok, float(logp[i, tok]),
                         tuple(zip(top_ids[i].tolist(), top_values[i].tolist())))
            for i, tok in enumerate(token_ids)]
