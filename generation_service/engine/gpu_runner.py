"""Decode steps on the GPU: persistent buffers, CUDA graphs, the step channel inside the graph.

One decode step of bucket b (the body captured by `DecodeGraphs`), mask prefetch on:

    main stream                                   side stream (one per runner, all graphs)
      fork ----------------------------------->   [channel] wait mask_seq (parity of N)
    forward(b rows) -> logits (b, V)              [channel] gather entry N % D rows [0, b)
      (`DecodeForward`, decode_forward.py; its      from mapped host memory -> mask buffer
      prologue kernel first stores [channel]        (kernels/mask_gather.py, a few CTAs)
      inputs_seq = the device step counter N)
      join <-----------------------------------
    sample (mask applied)                         kernels.mask_sample (greedy when temperature 0)
    epilogue: out_tokens; [channel] outputs of     kernels.step_epilogue (one launch, one program)
      entry N; feed: input_ids = tokens,
      positions, seq_lens += 1 for live rows;
      [channel] system fence, outputs_seq = N,
      N += 1 and its ring slot on the device

Captured nodes of a channel step besides the forward: 1 memop (the wait) and 4 kernels
(gather, mask_sample's two, the epilogue); bucket >= 16 forks the wait and the gather onto the
side stream at the start of the step, below 16 just before the LM head (`prefetch_at_head`), so
there they run beside the head alone; the `+serial` variants run them after the forward on
the main stream. A/B switches, read at capture:
`fold_inputs_seq = False` publishes inputs_seq as before, a write memop (the fence) and a copy
kernel ahead of the forward; `fold_step_tail = False` ends the step with the epilogue without
the seq, then `publish_step_seq` + `advance_channel_step` (a write memop and 3 kernels);
`mask_gather_programs = 0` gathers with torch.index_select, whose blocks fill every SM while
their loads cross the bus; `prefetch_at_head = False` reads below 16 after the forward as the
`+serial` variants do; `ring_mask_read` (reads after the forward only, off by default) lets
mask_sample read entry N % D in place: one kernel fewer.

grammar_service publishes step N's masks usually long before the forward ends, so the
wait and the PCIe read of the mask rows (~2 MB at b=128, vocab 131k) leave the critical
path. The `+serial` variants (`mask_prefetch=False`) run the wait and the gather on the
main stream after the forward instead: the same kernels, the same buffers, so the same tokens.
Buckets below `prefetch_min_bucket` (16) fork late, at the LM head: there the forward is a chain
of PDL-linked kernels, and a branch forked at the start of the step slowed it by more than the
gather it hides (24 us at 1B B=8 on an H200); forked at the head it costs nothing measurable
and hides the wait node too (docs/gpu.md, "Where the masks are read").

Capture: the side stream forks at the start of the step (below 16: before the LM head) and
joins before the sampler reads the mask buffer; both are event edges, so in a graph the wait +
gather become a branch parallel to the forward, and a replay ends only when both branches have.
The mask buffer `(max_batch, mask_words)` is allocated per mapped channel in `_map_channel`,
never in the capture pool; steps on one stream are ordered, and the fork waits for everything
before it (the previous step's sampler included), so the gather of step N+1 never overwrites
masks step N still reads.

Why a parity wait: a captured cuStreamWaitValue32 has its value baked in, but N changes
every replay. While step N waits, mask_seq is N-1 or N (grammar_service publishes M only
after the GPU wrote inputs_seq = M, which happens in step M, and step N-1's wait, on
whichever stream, ended before step N began), so "bit 0 of mask_seq == bit 0 of N" is exact
(also for a side-stream wait issued before inputs_seq = N lands): odd N waits with WAIT_AND 1,
even N with WAIT_NOR ~1. (`prepublished`, a benchmark variant whose wait always passes, breaks
this; benchmarks/decode.py restores it after a run.) Two graph copies per bucket and mask read,
chosen by the host that knows N. The writes take N from a device counter, so nothing is patched
per replay: inputs_seq by the prologue kernel after a system fence (or a kernel store after a
cuStreamWriteValue32 fence); outputs_seq by the epilogue, after each thread's fence.sc.sys and
a CTA barrier (kernels/step_epilogue.py), which then advances the counter for step N + 1.
Eager mode (debugging, the reference in tests) waits with GEQ N and writes N directly, on
the same streams as the graph (the epilogue without the seq, then the memop and the advance).

The host only touches rows that change (`load_rows`, `scrub_tail`), never waits for the GPU
to build step N+1 (it reads tokens from the outputs area after outputs_seq), and picks the
graph. Without a step channel (`mapped=None`) only the free variant exists.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from generation_service.engine.cuda_graphs import (
    DEFAULT_BUCKETS, FREE, SERVING_VARIANTS, DecodeBuffers, DecodeGraphs, GraphVariant, bucket_for, capture_graphs,
    with_filters, with_serial,
)
from generation_service.engine.decode_forward import DecodeForward
from generation_service.engine.kv_cache import KVCache

log = logging.getLogger(__name__)


PREFETCH_MIN_BUCKET = 16
# CTAs of the side stream's mask gather (kernels/mask_gather.py): enough 32 KB tiles in flight
# to keep the host link busy, few enough SMs that the forward beside it keeps the rest; 4, not
# 2: twice the loads in flight when a late mask puts the gather on the critical path. The sweep:
# docs/gpu.md, "Where the masks are read".
MASK_GATHER_PROGRAMS = 4
# Below PREFETCH_MIN_BUCKET the prefetch variants fork the mask wait + gather beside the LM head
# (the forward's last launch): it hides the wait node, the gather and up to the head's time of a
# late grammar_service, at no branch cost (docs/gpu.md, "Where the masks are read").
PREFETCH_AT_HEAD = True


def publish_step_seq(mapped, fence: torch.Tensor, step_counter: torch.Tensor, which: str) -> None:
    """Captured: inputs_seq / outputs_seq = the device step counter N.

    NOTE: the memop write fences (like __threadfence_system) so the outputs written above
    are visible before the sequence number the next kernel stores. A kernel, not copy_,
    which may become a D2D memcpy node aimed at host memory."""
    from step_channel.cuda import driver
    driver().write_value32(torch.cuda.current_stream().cuda_stream, fence.data_ptr(), 0)
    torch.add(step_counter, 0, out=mapped.seq_view(which))


def wait_mask_parity(mapped, parity: int) -> None:
    """Captured: block the current stream until mask_seq has the parity of N (module docstring)."""
    from step_channel.cuda import WAIT_AND, WAIT_NOR
    if parity == 1:
        mapped.wait_value32(None, "mask_seq", 1, WAIT_AND)
    else:
        mapped.wait_value32(None, "mask_seq", 0xFFFFFFFE, WAIT_NOR)


def advance_channel_step(buffers, depth: int) -> None:
    """On the device, after outputs_seq = N: N += 1 and the ring slot of N + 1."""
    buffers.step.add_(1)
    torch.remainder(buffers.step, depth, out=buffers.ring_slot)  # int32 -> int64 in one kernel


def apply_bitmask_torch(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """logits (R, V) in place: -inf where the token's bit (word t//32, bit t%32) is clear."""
    num_rows, vocab = logits.shape
    shifts = torch.arange(8, device=logits.device, dtype=torch.uint8)
    bits = (masks.contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1  # (R, 4W, 8)
    allowed = bits.view(num_rows, -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


class GpuDecodeRunner:
    """Decode steps of one model over persistent buffers, eager or as CUDA graphs."""

    def __init__(self, model, kv: KVCache, *, max_batch: int = 128, buckets=DEFAULT_BUCKETS,
                 mapped=None, variants: tuple[GraphVariant, ...] | None = None,
                 sampler: str = "triton", fuse_weights: bool = True, fused_ops: bool | None = None,
                 mask_prefetch: bool = True) -> None:
        self.model = model
        self.config = model.config
        self.kv = kv
        self.device = kv.device
        self.buckets = tuple(b for b in sorted(buckets) if b <= max_batch)
        self.max_batch = self.buckets[-1]
        self.mapped = mapped
        self.sampler = sampler
        self.fused_epilogue = True  # read at capture; False: the torch ops (A/B, profile_step.py)
        # Read at capture: the fused epilogue also publishes outputs_seq and advances N (one
        # launch); False: `publish_step_seq` + `advance_channel_step` after it (A/B).
        self.fold_step_tail = True
        max_pages = -(-self.config.max_position_embeddings // kv.page_size)
        self.buffers = DecodeBuffers.allocate(self.max_batch, max_pages, self.device)
        self.forward = DecodeForward(model, kv, self.buffers, fuse_weights=fuse_weights, fused_ops=fused_ops)
        self.mask_prefetch = mask_prefetch  # the default of `step`; `+serial` variants read masks after the forward
        # Buckets below this do not fork the mask read at the step's start: that branch beside the
        # forward's PDL-chained small-bucket kernels cost more than the gather it hides
        # (24 us at 1B B=8 on an H200); see prefetch_at_head. Read at capture.
        self.prefetch_min_bucket = PREFETCH_MIN_BUCKET
        # Read at capture: masks read after the forward (no prefetch) go straight from the mapped
        # ring into the sampler, no gather kernel (`_masks_after_forward`). Off: within noise at 1B
        # (docs/gpu.md, "Where the masks are read"; the sampler's slice loop pays a PCIe
        # latency per 1024 tokens where the gather pays one), and the head fork reads first.
        self.ring_mask_read = False
        # Read at capture: CTAs of the prefetching side stream's mask gather; 0: torch.index_select
        # everywhere (A/B: it fills every SM while its loads cross the bus).
        self.mask_gather_programs = MASK_GATHER_PROGRAMS
        # Read at capture: the forward's prologue kernel publishes inputs_seq (fused path); False:
        # a write memop and a copy kernel before the forward (A/B).
        self.fold_inputs_seq = True
        # Read at capture: below prefetch_min_bucket, prefetch variants fork the mask wait and
        # gather at the LM head (the forward's last launch) instead of reading after the forward;
        # False: they read after the forward like the +serial ones (A/B).
        self.prefetch_at_head = PREFETCH_AT_HEAD
        # Read at capture (diagnostics, benchmarks/decode.py --wait-stamps): (R, 2) int64 on the
        # device; a channel step N stores %globaltimer at [N % R] before (0) and after (1) its wait
        self.wait_stamps: torch.Tensor | None = None
        if variants is None:
            variants = SERVING_VARIANTS if mapped is not None else (FREE,)
        self.variants = self._own_variants(variants)
        self.graphs: DecodeGraphs | None = None
        self.next_channel_step = 1
        self._eager_step = 0
        self._capturing = False
        self._fence = torch.zeros(1, dtype=torch.int32, device=self.device)
        mb = self.max_batch
        self._temperature = torch.zeros(mb, dtype=torch.float32, device=self.device)
        self._top_k = torch.zeros(mb, dtype=torch.int32, device=self.device)
        self._top_p = torch.ones(mb, dtype=torch.float32, device=self.device)
        self._seeds = torch.zeros(mb, dtype=torch.int64, device=self.device)
        self._side: torch.cuda.Stream | None = None  # the mask-prefetch stream, made once
        self._mask_rows: torch.Tensor | None = None  # (max_batch, W) masks of the step, on the device
        if mapped is not None:
            self._map_channel(mapped)

    def _map_channel(self, mapped) -> None:
        g = mapped.channel.geometry
        if g.max_batch < self.max_batch:
            raise ValueError(f"channel max_batch {g.max_batch} < largest bucket {self.max_batch}")
        self.mapped = mapped
        self.depth = g.depth
        # (D, max_batch, P, W) masks and (D, max_batch, P) tokens: row r position 0 of each entry.
        self._masks = mapped.ring_view("masks", (g.max_batch, g.max_positions, g.mask_words))[:, :, 0, :]
        self._out_tokens = mapped.ring_view("out_tokens", (g.max_batch, g.max_positions))[:, :, 0]
        self._out_counts = mapped.ring_view("out_counts", (g.max_batch,))
        self.mask_vocab = min(g.vocab_size, self.config.vocab_size)
        # NOTE: persistent, outside any capture pool: the side stream writes it, the main
        # stream's sampler reads it after the join (a pool block could be reused in between).
        self._mask_rows = torch.zeros(self.max_batch, g.mask_words, dtype=torch.int32, device=self.device)
        if self._side is None:  # one stream for every graph and every channel of this runner
            self._side = torch.cuda.Stream(device=self.device)
        self.buffers.set_step(self.next_channel_step, self.depth)

    def _own_variants(self, variants: tuple[GraphVariant, ...]) -> tuple[GraphVariant, ...]:
        """`variants` as this runner captures them: without mask prefetch, serial channel variants."""
        return variants if self.mask_prefetch else tuple(dict.fromkeys(with_serial(v) for v in variants))

    def attach_channel(self, mapped, variants: tuple[GraphVariant, ...], first_step: int) -> None:
        """Serve a (new) step channel: graphs over the old region are dropped first, then the
        graphs of `variants` are captured over this one (a reconnect; seconds, not per step).
        `mapped=None` detaches: the caller unregisters the old region after this returns."""
        self.close()
        torch.cuda.synchronize(self.device)
        self.mapped = None
        if mapped is not None:
            self.next_channel_step = first_step
            self._map_channel(mapped)
        self.variants = self._own_variants(variants)
        # NOTE: warm-up runs the body on whatever rows are loaded; padding everywhere keeps its
        # K/V writes in the dummy page (a finished request's pages may belong to another now).
        self.buffers.scrub_tail(0, self.max_batch)
        self.capture()

    # ---- the forward -----------------------------------------------------------------
    def decode_forward(self, bucket: int, publish: tuple[torch.Tensor, torch.Tensor] | None = None,
                       before_head: Callable[[], None] | None = None) -> torch.Tensor:
        """(bucket, vocab) logits of one token per row from the persistent buffers; publish: the
        prologue also stores inputs_seq; before_head: called before the LM head's launch
        (`DecodeForward.__call__`)."""
        return self.forward(bucket, publish, before_head)

    # ---- the step body -----------------------------------------------------------------
    def _publish(self, which: str) -> None:
        if self._capturing:
            publish_step_seq(self.mapped, self._fence, self.buffers.step, which)
        else:
            self.mapped.write_value32(None, which, self._eager_step)

    def _wait_masks(self, variant: GraphVariant) -> None:
        """Block the current stream until step N's masks are published."""
        from step_channel.cuda import WAIT_GEQ
        if variant.parity is None:  # PREPUBLISHED (benchmarks): (int32)(mask_seq - 0) >= 0 always holds
            self.mapped.wait_value32(None, "mask_seq", 0, WAIT_GEQ)
        elif not self._capturing:
            self.mapped.wait_value32(None, "mask_seq", self._eager_step, WAIT_GEQ)
        else:
            wait_mask_parity(self.mapped, variant.parity)

    def _read_masks(self, bucket: int, variant: GraphVariant, programs: int | None = None) -> torch.Tensor:
        """On the current stream: wait for step N's masks (channel steps), then gather rows
        [0, bucket) of entry N % D (index = the device ring slot) from mapped host memory
        into the persistent mask buffer. Returns its (bucket, W) rows. programs: the gather's
        CTAs (None: all its tiles at once, for the main stream)."""
        stamps = self.wait_stamps is not None and variant.waits and self._capturing
        if stamps:
            from generation_service.kernels.stamp import stamp
            stamp(self.wait_stamps, self.buffers.step, 0)
        if variant.waits:
            self._wait_masks(variant)
        if stamps:
            stamp(self.wait_stamps, self.buffers.step, 1)
        rows = self._mask_rows[:bucket]
        if self.mask_gather_programs and self.sampler == "triton":
            from generation_service.kernels.mask_gather import mask_gather
            mask_gather(self._masks[:, :bucket], self.buffers.ring_slot, rows, programs)
        else:  # (1, bucket, W) <- (D, bucket, W)[ring_slot]: one kernel, no temporary
            torch.index_select(self._masks[:, :bucket], 0, self.buffers.ring_slot, out=rows.unsqueeze(0))
        return rows

    def _masks_after_forward(self, bucket: int, variant: GraphVariant) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step N's masks read on the main stream after the forward: (the gathered (bucket, W)
        rows, None), or with `ring_mask_read` (the ring's (D, bucket, W) rows, the device ring
        slot) for the sampler to read entry N % D in place, one kernel fewer. Not for top-k/top-p
        (their search re-reads each row ~20 times: over PCIe, not HBM) nor the torch sampler."""
        if not self.ring_mask_read or variant.filters or self.sampler != "triton":
            return self._read_masks(bucket, variant), None
        if variant.waits:
            self._wait_masks(variant)
        return self._masks[:, :bucket], self.buffers.ring_slot

    def _sample(self, logits: torch.Tensor, masks: torch.Tensor | None, bucket: int,
                filters: bool = False, mask_slot: torch.Tensor | None = None) -> torch.Tensor:
        if self.sampler == "triton":
            from generation_service.kernels.mask_sample import mask_sample
            ids, _ = mask_sample(logits, masks, self._temperature[:bucket], self._top_k[:bucket],
                                 # the token's position is the philox step: a new draw per token,
                                 # the same draw for the same (seed, position) in any batch layout
                                 self._top_p[:bucket], self._seeds[:bucket], self.buffers.positions[:bucket],
                                 mask_vocab_size=self.mask_vocab if masks is not None else None,
                                 enable_filters=filters, mask_slot=mask_slot)
            return ids
        if filters:
            raise RuntimeError("the torch fallback sampler is greedy only; top-k/top-p need mask_sample")
        logits = logits.float().nan_to_num(nan=float("-inf"))
        if masks is not None:
            apply_bitmask_torch(logits, masks)
        return logits.argmax(dim=-1)

    def _epilogue(self, tokens: torch.Tensor, bucket: int, variant: GraphVariant) -> None:
        """One launch: out_tokens, the channel's outputs at the ring slot, and the sampled tokens
        fed back (the host overwrites rows it changes before the next step; it reads nothing
        of these before outputs_seq). A captured channel step also publishes outputs_seq = N
        and advances N in it (`fold_step_tail`); eager steps keep the memop that writes the
        host's N (module docstring)."""
        from generation_service.kernels.step_epilogue import MAX_PUBLISH_ROWS, step_epilogue, step_epilogue_torch
        buf = self.buffers
        channel = (buf.ring_slot, self._out_tokens, self._out_counts) if variant.uses_channel else None
        folds = (variant.waits and self._capturing and self.fused_epilogue and self.fold_step_tail
                 and bucket <= MAX_PUBLISH_ROWS)
        if self.fused_epilogue:
            publish = (buf.step, self.mapped.seq_view("outputs_seq")) if folds else None
            step_epilogue(tokens, buf.out_tokens, buf.input_ids, buf.positions, buf.seq_lens, channel, publish)
        else:
            step_epilogue_torch(tokens, buf.out_tokens, buf.input_ids, buf.positions, buf.seq_lens, channel)
        if variant.waits and not folds:
            self._publish("outputs_seq")
            advance_channel_step(buf, self.depth)

    def body(self, bucket: int, variant: GraphVariant) -> None:
        # a captured channel step's prologue kernel stores inputs_seq = N (its first node)
        folds_inputs = (variant.waits and self._capturing and self.fold_inputs_seq
                        and self.forward.publishes_inputs)
        if variant.waits and not folds_inputs:
            self._publish("inputs_seq")
        # NOTE: below prefetch_min_bucket a prefetch variant forks at the LM head, or reads its
        # masks after the forward (prefetch_at_head False)
        prefetches = variant.prefetches and bucket >= self.prefetch_min_bucket
        at_head = variant.prefetches and not prefetches and self.prefetch_at_head
        main = torch.cuda.current_stream()

        def fork(programs: int | None) -> None:
            # NOTE: the side stream sees the host's row updates and the previous step's sampler
            # (so its gather never overwrites masks step N-1 still reads); its wait may be issued
            # before inputs_seq = N lands: mask_seq is still N-1 or N (module docstring).
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side):
                self._read_masks(bucket, variant, programs)
        if prefetches:
            fork(self.mask_gather_programs)
        publish = (self.buffers.step, self.mapped.seq_view("inputs_seq")) if folds_inputs else None
        # at the head nothing runs beside the gather but the LM head: every tile at once
        logits = self.decode_forward(bucket, publish, (lambda: fork(None)) if at_head else None)
        masks = mask_slot = None
        if prefetches or at_head:
            main.wait_stream(self._side)  # NOTE: join before the sampler reads the buffer (and before capture ends)
            masks = self._mask_rows[:bucket]
        elif variant.uses_channel:
            masks, mask_slot = self._masks_after_forward(bucket, variant)
        tokens = self._sample(logits, masks, bucket, variant.filters, mask_slot)  # (b,) int32 or int64
        self._epilogue(tokens, bucket, variant)

    # ---- driving ------------------------------------------------------------------------
    def warmup(self, bucket: int) -> None:
        """One free step on scratch state (compiles kernels); buffers restored afterwards."""
        saved = [t.clone() for t in (self.buffers.input_ids, self.buffers.positions, self.buffers.seq_lens)]
        try:
            self.body(bucket, FREE)
            if any(v.filters for v in self.variants):  # compile the filtered sampler before capture
                self.body(bucket, with_filters(FREE))
        except Exception:  # noqa: BLE001 -- a broken sampler kernel must not stop decoding
            if self.sampler == "torch" or any(v.filters for v in self.variants):
                raise
            log.exception("triton sampler failed; falling back to the torch sampler")
            self.sampler = "torch"
            self.body(bucket, FREE)
        for t, s in zip((self.buffers.input_ids, self.buffers.positions, self.buffers.seq_lens), saved):
            t.copy_(s)

    @torch.no_grad()
    def capture(self) -> float:
        """Capture every bucket x variant; returns seconds spent."""
        self.graphs = capture_graphs(self, self.buckets, self.variants)
        return self.graphs.capture_s

    def step(self, batch_size: int, constrained: bool = False, wait: bool = True,
             use_graph: bool = True, filters: bool = False, prefetch: bool | None = None,
             variant: GraphVariant | None = None) -> GraphVariant:
        """Launch one decode step of rows [0, batch_size). Returns the variant run.

        A constrained step is channel step `next_channel_step`: its descriptor must be
        written before this call. `prefetch` (None: the runner's `mask_prefetch`) picks the
        side-stream or the `+serial` mask read; `variant` replaces the choice (benchmarks).
        """
        bucket = bucket_for(batch_size, self.buckets)
        self.buffers.scrub_tail(batch_size, bucket)
        step = self.next_channel_step
        if variant is None:
            prefetch = self.mask_prefetch if prefetch is None else prefetch
            variant = GraphVariant.for_step(constrained, step, wait, filters, prefetch)
        if use_graph and self.graphs is not None:
            self.graphs.replay(bucket, variant)
        else:
            self._eager_step = step
            self.body(bucket, variant)
        if variant.waits:
            self.next_channel_step += 1
        return variant

    def load_rows(self, input_ids, positions, seq_lens, page_table, start: int = 0) -> None:
        self.buffers.set_rows(start, input_ids, positions, seq_lens, page_table)

    def load_sampling(self, start: int, temperature: torch.Tensor, seeds: torch.Tensor,
                      top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None) -> None:
        """Per-row temperature (0 = greedy), seed, top-k (0 = off) and top-p (1 = off) for
        rows [start, start+n). top-k/top-p act only in the `+filters` variants
        (`step(..., filters=True)`); the plain variants compile them out."""
        n = temperature.shape[0]
        self._temperature[start:start + n].copy_(temperature, non_blocking=True)
        self._seeds[start:start + n].copy_(seeds, non_blocking=True)
        if top_k is None:
            self._top_k[start:start + n].zero_()
        else:
            self._top_k[start:start + n].copy_(top_k, non_blocking=True)
        if top_p is None:
            self._top_p[start:start + n].fill_(1.0)
        else:
            self._top_p[start:start + n].copy_(top_p, non_blocking=True)

    def set_channel_step(self, step: int) -> None:
        """The next channel step (OpenChannel's first_step, or after a reconnect)."""
        self.next_channel_step = step
        self.buffers.set_step(step, self.depth)

    def close(self) -> None:
        """Graphs first (see cuda_graphs' teardown order); the caller then unregisters."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
