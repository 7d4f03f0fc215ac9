"""Speculative verify steps as CUDA graphs (`EngineConfig.verify_graphs`).

A verify batch has rows of 1 + k tokens (the last known token, then k n-gram drafts,
k <= max_draft_tokens). One width w = 1 + max_draft_tokens serves every k: row b brings
num_new[b] <= w tokens, packed row-major by `kernels.prepare_inputs` (a device scalar
num_rows, so a graph of bucket B serves 1..B rows), hence one graph per (bucket of rows,
variant) over T = B * w token slots:

    [channel] inputs_seq = N     fence + device step counter (shared with the decode graphs)
    prepare_decode_inputs        positions, cache slots, seq_lens, extend_lens; padding scrubbed
    forward(T token slots)       DecodeForward's layer loop, `extend_attention(max_extend_len=w)`
                                 over the paged cache, cuBLAS GEMMs, LM head on every slot
    [channel] wait mask_seq      parity of N (as the decode graphs), then the mask row of every
                                 token slot (row r, position j) from entry N % D, mapped memory
    mask_sample (T rows)         per token: its row's temperature and seed, Philox step = the
                                 token's position (what a decode step at that position draws)
    verify                       row r accepts draft j (input token j, 1 <= j < num_new) while
                                 sampled[j-1] == input[j] and, on a grammar step, j < valid_positions[r]
    outputs                      sampled[r, :w] and count = accepted + 1 into the buffers;
                                 [channel] into entry N, then outputs_seq = N, N += 1 on the device

Why "sample == draft" is the verify rule: a draft is a point mass q(d) = 1; accepting it with
probability p(d) and otherwise drawing from p without d (the speculative rule,
speculative.accept_rejection) is exactly "draw x ~ p, accept iff x == d, else emit x": the
draw at position j is a sample of p_j, and conditioned on x != d it is p_j without d. Greedy
is the argmax case (`accept_greedy`). The draws differ from the CPU rule's generators, so a
seeded sampled request gives other (equally distributed) tokens under verify graphs.

Masks: row r's mask rows are r * max_positions + j of the entry (docs/step_channel.md);
positions past valid_positions[r] are all ones there, and the verifier never uses them (a draft
the grammar rejected is excluded by the mask before it, so its sample differs from it).

Rows with top-k/top-p (no `+filters` variants here), logprobs, or more tokens than w are
not graphed (`can_run`); the engine's eager path takes them. Steps are serial: masks are read
after the forward on the one stream (no prefetch branch).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from generation_service.engine.cuda_graphs import (
    FREE, WAIT_EVEN, WAIT_ODD, DecodeGraphs, GraphVariant, bucket_for, capture_graphs,
)
from generation_service.engine.decode_forward import DecodeMeta
from generation_service.engine.gpu_runner import advance_channel_step, publish_step_seq, wait_mask_parity
from generation_service.engine.kv_cache import DUMMY_PAGE
from generation_service.engine.sampler import device_seed

log = logging.getLogger(__name__)

VERIFY_VARIANTS = (FREE, WAIT_EVEN, WAIT_ODD)


@dataclass
class VerifyBuffers:
    """Inputs and outputs of a captured verify step; allocated once at the largest bucket.

    Token slots are packed row-major (prepare_inputs); (max_rows, width) grids are per row."""

    input_ids: torch.Tensor        # (max_tokens,) int64 packed tokens (clamped, tail scrubbed on device)
    seq_lens_before: torch.Tensor  # (max_rows,) int32 num_cached of each row
    num_new: torch.Tensor          # (max_rows,) int32 1 + drafts of each row
    num_rows: torch.Tensor         # (1,) int32 real rows of the step
    page_table: torch.Tensor       # (max_rows, max_pages) int32 (0 = dummy page)
    mask_rows: torch.Tensor        # (max_tokens,) int64 entry mask row of each slot: row * P + j
    token_index: torch.Tensor      # (max_rows, width) int64 slot of (row, j), j past the row: its last
    drafts: torch.Tensor           # (max_rows, width) int64 input token j for 1 <= j < num_new, else -1
    temperature: torch.Tensor      # (max_tokens,) float32 per slot (its row's)
    seeds: torch.Tensor            # (max_tokens,) int64 per slot (its row's, 63 bits)
    top_k: torch.Tensor            # (max_tokens,) int32, always 0 (no filtered rows)
    top_p: torch.Tensor            # (max_tokens,) float32, always 1
    out_tokens: torch.Tensor       # (max_rows, width) int64 sampled token of every position
    out_counts: torch.Tensor       # (max_rows,) int64 accepted drafts + 1

    @classmethod
    def allocate(cls, max_rows: int, width: int, max_pages: int, device) -> "VerifyBuffers":
        def z(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)
        max_tokens = max_rows * width
        return cls(input_ids=z(max_tokens), seq_lens_before=z(max_rows, dtype=torch.int32),
                   num_new=z(max_rows, dtype=torch.int32), num_rows=z(1, dtype=torch.int32),
                   page_table=z(max_rows, max_pages, dtype=torch.int32), mask_rows=z(max_tokens),
                   token_index=z(max_rows, width), drafts=z(max_rows, width) - 1,
                   temperature=z(max_tokens, dtype=torch.float32), seeds=z(max_tokens),
                   top_k=z(max_tokens, dtype=torch.int32),
                   top_p=z(max_tokens, dtype=torch.float32) + 1.0,
                   out_tokens=z(max_rows, width), out_counts=z(max_rows))


@dataclass
class HostRows:
    """One step's rows as host tensors of the buffers' full sizes (copied in whole)."""

    input_ids: torch.Tensor
    seq_lens_before: torch.Tensor
    num_new: torch.Tensor
    mask_rows: torch.Tensor
    token_index: torch.Tensor
    drafts: torch.Tensor
    temperature: torch.Tensor
    seeds: torch.Tensor
    page_table: torch.Tensor  # (num_rows, widest row's pages)


def pack_rows(rows, width: int, max_rows: int, max_positions: int, vocab_size: int) -> HostRows:
    """Host layout of `rows` (ScheduledRows of 1 + drafts input tokens, all sampling)."""
    max_tokens = max_rows * width
    host = HostRows(
        input_ids=torch.zeros(max_tokens, dtype=torch.int64),
        seq_lens_before=torch.zeros(max_rows, dtype=torch.int32),
        num_new=torch.zeros(max_rows, dtype=torch.int32),
        mask_rows=torch.zeros(max_tokens, dtype=torch.int64),
        token_index=torch.zeros(max_rows, width, dtype=torch.int64),
        drafts=torch.full((max_rows, width), -1, dtype=torch.int64),
        temperature=torch.zeros(max_tokens, dtype=torch.float32),
        seeds=torch.zeros(max_tokens, dtype=torch.int64),
        page_table=torch.zeros(len(rows), max(len(row.request.pages) for row in rows), dtype=torch.int32))
    start = 0
    for r, row in enumerate(rows):
        ids, n = row.input_ids, len(row.input_ids)
        assert 1 <= n <= width, (n, width)
        end = start + n
        host.input_ids[start:end] = torch.tensor(ids, dtype=torch.int64).clamp_(0, vocab_size - 1)
        host.seq_lens_before[r] = row.num_cached
        host.num_new[r] = n
        host.mask_rows[start:end] = torch.arange(n) + r * max_positions
        host.token_index[r] = start + torch.arange(width).clamp_(max=n - 1)
        host.drafts[r, 1:n] = torch.tensor(ids[1:], dtype=torch.int64)
        host.temperature[start:end] = row.request.sampling.temperature
        host.seeds[start:end] = device_seed(row.request.sample_seed)
        host.page_table[r, :len(row.request.pages)] = torch.tensor(row.request.pages, dtype=torch.int32)
        start = end
    return host


class VerifyGraphs:
    """Verify steps of rows x `width` tokens over the decode runner's model, cache, fused
    weights and channel step counter (`GpuDecodeRunner`: one counter N for both kinds of
    graph steps, so they interleave on one channel)."""

    def __init__(self, gpu, width: int, vocab_size: int) -> None:
        if width < 2:
            raise ValueError(f"verify graphs need a width of at least 2 (1 + drafts), got {width}")
        self.gpu = gpu
        self.width = width
        self.vocab_size = vocab_size
        self.device = gpu.device
        self.buckets = gpu.buckets
        self.max_rows = gpu.max_batch
        self.buffers = VerifyBuffers.allocate(self.max_rows, width, gpu.buffers.page_table.shape[1], self.device)
        from generation_service.kernels.prepare_inputs import PreparedInputs
        self.prepared = PreparedInputs.allocate(self.max_rows, self.max_rows * width, self.device)
        self.mapped = None
        self.max_positions = width  # mask rows per row of an entry (the channel's, once mapped)
        self.variants: tuple[GraphVariant, ...] = (FREE,)
        self.graphs: DecodeGraphs | None = None
        self._capturing = False
        self._fence = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._draft_positions = torch.arange(1, width, device=self.device).view(1, -1)  # j of draft j
        # A free step's tokens and counts reach the host through pinned memory behind an event.
        self.host_tokens = torch.zeros(self.max_rows, width, dtype=torch.int64, pin_memory=True)
        self.host_counts = torch.zeros(self.max_rows, dtype=torch.int64, pin_memory=True)
        self.copy_ready = torch.cuda.Event()
        self.num_steps = 0
        self.num_channel_steps = 0

    # ---- which rows ----------------------------------------------------------------------
    def can_run(self, rows) -> bool:
        """Every row a sampling decode row of 1 + drafts tokens that fit the width, without
        logprobs, top-k/top-p or logits processing (the eager verify applies it), within the
        page table; the rows fit the largest bucket."""
        max_pages = self.buffers.page_table.shape[1]
        return 0 < len(rows) <= self.max_rows and all(
            row.is_sampling and len(row.input_ids) == 1 + len(row.drafts) <= self.width
            and row.request.sampling.num_logprobs == 0 and len(row.request.pages) <= max_pages
            and not row.request.sampling.uses_filters
            and not row.request.sampling.uses_logit_processing for row in rows)

    # ---- the channel ---------------------------------------------------------------------
    def attach_channel(self, mapped) -> None:
        """Drop the graphs, map `mapped` (None: none), capture free (+ the waiting pair)."""
        self.close()
        self.mapped = mapped
        self.variants = (FREE,)
        if mapped is not None:
            g = mapped.channel.geometry
            if g.max_batch < self.max_rows or g.max_positions < self.width:
                raise ValueError(f"channel {g} too small for {self.max_rows} rows x {self.width} positions")
            self.max_positions = g.max_positions
            self.depth = g.depth
            self._masks = mapped.ring_view("masks", (g.max_rows, g.mask_words))  # (D, MB * P, W)
            self._valid = mapped.ring_view("valid_positions", (g.max_batch,))  # (D, MB)
            self._out_tokens = mapped.ring_view("out_tokens", (g.max_batch, g.max_positions))  # (D, MB, P)
            self._out_counts = mapped.ring_view("out_counts", (g.max_batch,))  # (D, MB)
            self.mask_vocab = min(g.vocab_size, self.gpu.config.vocab_size)
            self.variants = VERIFY_VARIANTS
        self.capture()

    # ---- the step body -------------------------------------------------------------------
    def _publish(self, which: str) -> None:
        """inputs_seq / outputs_seq = N from the device counter shared with the decode graphs."""
        assert self._capturing, "channel variants run only as graphs"
        publish_step_seq(self.mapped, self._fence, self.gpu.buffers.step, which)

    def _attend(self, bucket: int):
        cfg, kv, prep = self.gpu.config, self.gpu.kv, self.prepared
        meta = DecodeMeta(self.buffers.page_table[:bucket], prep.seq_lens[:bucket], prep.extend_lens[:bucket])
        scale = cfg.head_dim ** -0.5
        attention = self.gpu.forward.attention

        def attend(q: torch.Tensor, index: int) -> torch.Tensor:
            return attention.extend(q, kv.k[index], kv.v[index], meta, scale, max_extend_len=self.width,
                                    sliding_window=cfg.sliding_window, **kv.scales(index))
        return attend

    def body(self, bucket: int, variant: GraphVariant) -> None:
        from generation_service.kernels.mask_sample import mask_sample
        from generation_service.kernels.prepare_inputs import prepare_decode_inputs
        buf, prep, width, step = self.buffers, self.prepared, self.width, self.gpu.buffers
        num_tokens = bucket * width
        if variant.waits:
            self._publish("inputs_seq")
        ids = buf.input_ids[:num_tokens]
        prepare_decode_inputs(ids, buf.seq_lens_before[:bucket], buf.num_new[:bucket],
                              buf.page_table[:bucket], buf.num_rows, prep, self.gpu.kv.page_size,
                              self.vocab_size, max_new_per_row=width)
        positions = prep.positions[:num_tokens]
        logits = self.gpu.forward.tokens(ids, positions, prep.slot_ids[:num_tokens], self._attend(bucket))
        masks = valid = None
        if variant.uses_channel:
            if variant.waits:
                assert self._capturing and variant.parity is not None, "channel variants run only as graphs"
                wait_mask_parity(self.mapped, variant.parity)
            # (T, W) mask rows of entry N % D: one gather from mapped host memory
            masks = self._masks[step.ring_slot, buf.mask_rows[:num_tokens]]
            valid = self._valid[:, :bucket].index_select(0, step.ring_slot).view(bucket)
        sampled, _ = mask_sample(logits, masks, buf.temperature[:num_tokens], buf.top_k[:num_tokens],
                                 buf.top_p[:num_tokens], buf.seeds[:num_tokens], positions,
                                 mask_vocab_size=self.mask_vocab if masks is not None else None,
                                 enable_filters=False)
        grid = sampled.long().index_select(0, buf.token_index[:bucket].view(-1)).view(bucket, width)
        # draft j is accepted iff the token sampled at position j - 1 is that draft (and its
        # mask row was exact), and every draft before it was accepted
        match = grid[:, :-1] == buf.drafts[:bucket, 1:]  # (b, w - 1)
        if valid is not None:
            match &= self._draft_positions < valid.view(-1, 1)
        counts = torch.cumprod(match.long(), dim=1).sum(dim=1) + 1  # (b,) accepted drafts + 1
        buf.out_tokens[:bucket].copy_(grid)
        buf.out_counts[:bucket].copy_(counts)
        if variant.uses_channel:
            self._out_tokens[:, :bucket, :width].index_put_((step.ring_slot,), grid.int().view(1, bucket, width))
            self._out_counts[:, :bucket].index_put_((step.ring_slot,), counts.int().view(1, bucket))
        if variant.waits:
            self._publish("outputs_seq")
            advance_channel_step(step, self.depth)

    # ---- driving -------------------------------------------------------------------------
    def warmup(self, bucket: int) -> None:
        """One free step over padding only (compiles the kernels; K/V land in the dummy page)."""
        self.buffers.num_rows.zero_()
        self.body(bucket, FREE)

    @torch.no_grad()
    def capture(self) -> None:
        self.graphs = capture_graphs(self, self.buckets, self.variants)
        log.info("verify graphs (width %d) captured in %.2f s", self.width, self.graphs.capture_s)

    def load(self, rows) -> None:
        """Rows [0, B) of the buffers from the scheduler's rows; the rest is padding."""
        host = pack_rows(rows, self.width, self.max_rows, self.max_positions, self.vocab_size)
        buf = self.buffers
        for name in ("input_ids", "seq_lens_before", "num_new", "mask_rows", "token_index", "drafts",
                     "temperature", "seeds"):
            getattr(buf, name).copy_(getattr(host, name), non_blocking=True)
        buf.num_rows.fill_(len(rows))
        buf.page_table.fill_(DUMMY_PAGE)
        buf.page_table[:len(rows), :host.page_table.shape[1]].copy_(host.page_table, non_blocking=True)

    def step(self, num_rows: int, constrained: bool) -> None:
        """Replay the verify graph of rows [0, num_rows). A constrained step is the decode
        runner's channel step `next_channel_step` (its descriptor written before this call)."""
        bucket = bucket_for(num_rows, self.buckets)
        gpu = self.gpu
        variant = FREE
        if constrained:
            variant = WAIT_ODD if gpu.next_channel_step & 1 else WAIT_EVEN
        self.graphs.replay(bucket, variant)
        self.num_steps += 1
        if constrained:
            gpu.next_channel_step += 1  # the graph moved the shared device counter on
            self.num_channel_steps += 1
        else:
            self.host_tokens[:num_rows].copy_(self.buffers.out_tokens[:num_rows], non_blocking=True)
            self.host_counts[:num_rows].copy_(self.buffers.out_counts[:num_rows], non_blocking=True)
            self.copy_ready.record()

    def free_results(self, num_rows: int) -> list[list[int]]:
        """A free step's tokens per row (accepted drafts + one), after its copy event."""
        self.copy_ready.synchronize()
        tokens, counts = self.host_tokens[:num_rows].tolist(), self.host_counts[:num_rows].tolist()
        return [row[:count] for row, count in zip(tokens, counts)]

    def close(self) -> None:
        """Graphs first (teardown order, cuda_graphs.py); the caller unregisters the region."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
