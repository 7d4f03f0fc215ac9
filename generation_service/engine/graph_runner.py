"""CudaGraphRunner: the engine's runner on CUDA (EngineConfig.runner "cuda_graph").

Decode-only batches (every row samples one new token, no drafts, no logprobs, bucket fits)
run as one replay of a captured decode graph (`GpuDecodeRunner`): sampling happens inside
the graph, and for a grammar step so do the channel's inputs_seq, the wait for mask_seq,
the mask apply and the outputs + outputs_seq. With `verify_width` (EngineConfig.verify_graphs)
batches whose rows carry speculative drafts replay a captured verify step instead
(`VerifyGraphs`, verify_graphs.py: rows x 1 + max drafts tokens, verify on the device, the
channel inside the graph alike). Every other batch (prefill chunks with or without decode
rows, logprobs, logits processing (penalties, logit_bias, min_p, min_tokens: the sampler
applies it, logit_processing.py), filtered or too wide verify rows) is a mixed step (`MixedForward`,
mixed_forward.py: one eager forward of all the step's tokens through the same fused weights
and kernels, varlen attention over the paged cache), sampled by the engine's Sampler (on the
device for one-position rows) with the host side of the step channel, so the engine mixes
both step kinds on one channel.

Per graph step the host (`launch`): writes rows [0, B) of the persistent buffers (the
scheduler's view is the truth; the graph's own feed-back is overwritten) and replays; then
(`collect`) learns the tokens without a device-wide sync: from the outputs area after
outputs_seq (grammar steps) or from a pinned copy behind a CUDA event (free steps).
Overlap (the engine, `EngineConfig.overlap`): a *chained* launch replays the next step of
the same rows before the previous one is collected; it writes only new page-table entries
and lets the graph's feed-back (token, position + 1, seq_len + 1) be the next inputs.

Channel lifetime: the graphs hold device pointers into one registered region. A region is
registered (and the serving variants captured over it) at its first graph step; before the
link unmaps it (watchdog disconnect, stop) `release_channel` drops the graphs, recaptures
the free variants and unregisters it (docs/gpu.md teardown order).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from generation_service.engine.cuda_graphs import DEFAULT_BUCKETS, FREE, SERVING_VARIANTS, with_filters
from generation_service.engine.fed_back import FedBack
from generation_service.engine.gpu_runner import GpuDecodeRunner
from generation_service.engine.kv_cache import DUMMY_PAGE, KVCache, page_table_of
from generation_service.engine.mixed_forward import MixedForward
from generation_service.engine.mixed_graphs import MixedGraphs
from generation_service.engine.pinned import PinnedStaging
from generation_service.engine.runner import ModelRunner
from generation_service.engine.sampler import SampleResult, device_seed, warm_device_sampler
from generation_service.engine.scheduler import ScheduledBatch, ScheduledRow
from generation_service.engine.step_time import MixedStepCost
from generation_service.engine.stream_channel import DeviceStreamChannel
from generation_service.engine.verify_graphs import VerifyGraphs
from step_channel.layout import seq_reached

log = logging.getLogger(__name__)
# A self-speculative draft's row: its uncached tokens, one after a verify or a first token.
DRAFT_TOKEN_BUCKET = 16


@dataclass
class Launch:
    """A replayed step whose tokens have not been read yet."""

    step: int | None              # its grammar step, None for a free step
    num_rows: int
    host_tokens: torch.Tensor | None = None  # free step: pinned copy of its tokens...
    ready: torch.cuda.Event | None = None    # ...complete once this event is
    verify: bool = False          # a verify step: rows of accepted drafts + one token


@dataclass
class _ProbeRequest:
    """What `MixedForward` reads of a request: its pages (the probes': the dummy page)."""

    pages: list[int]


def _median_s(run, repeats: int = 5) -> float:
    """Median wall seconds of `run()` to a synchronized device, after one warm-up call."""
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    return tuple(b for b in DEFAULT_BUCKETS if b < max_batch) + (max_batch,)


class CudaGraphRunner(ModelRunner):
    """ModelRunner whose `can_graph` batches replay captured steps (`launch` / `collect`,
    overlapped when the engine asks). Invariants: the graphs are captured over at
    most one registered region (`channel`); the GPU's channel step counter equals the link's
    step number whenever a grammar step is replayed; rows [0, B) of the persistent buffers
    are rewritten from the scheduler before every replay."""

    waits_for_every_mask = True

    supports_overlap = True

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, vocab_size: int, *,
                 max_batch: int, filters: bool = True, verify_width: int = 0,
                 max_context_tokens: int = 0) -> None:
        super().__init__(model, kv_cache, vocab_size)
        self.filters = filters
        self.gpu = GpuDecodeRunner(model, kv_cache, max_batch=max_batch, buckets=graph_buckets(max_batch),
                                   variants=self._variants((FREE,)))
        self.gpu.capture()
        self.mixed = MixedForward(self.gpu.forward)  # every batch no graph runs
        # Mixed steps of rows up to max_context_tokens long as graphs per token bucket (0: eager only)
        self.mixed_graphs: MixedGraphs | None = None
        self._context_pages = -(-max_context_tokens // kv_cache.page_size)
        if max_context_tokens:
            self.mixed_graphs = MixedGraphs(self.gpu.forward, self.gpu.max_batch, self._context_pages)
            self.mixed_graphs.capture()
        self._draft_graphs: MixedGraphs | None = None  # one row through the draft layers (`draft_logits`)
        self._warm_eager_mixed()
        self.channel = None     # the StepChannel the graphs are captured over
        self._mapped = None
        # Free steps' tokens: two pinned buffers + events, so that a step launched while the
        # previous one is uncollected (overlap) never overwrites the tokens not yet read.
        self._host_tokens = [torch.zeros(self.gpu.max_batch, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._copy_ready = [torch.cuda.Event() for _ in range(2)]
        self._next_copy = 0
        self._num_loaded_pages: list[int] = []  # per row: page-table entries written
        # A step's rows go up through pinned buffers (a pageable copy would wait for the step in
        # flight); a launch fed back uploads int64 twice, the rows' and the feed-back's index.
        self._staging = PinnedStaging(kv_cache.device, slots=4)
        self.num_graph_steps = 0
        self.num_chained_steps = 0  # launched before the previous step was read (overlap)
        self.num_mixed_steps = 0  # batches run by `mixed` (prefill chunks, logprobs, ...)
        # Verify steps as graphs of rows x verify_width (= 1 + max drafts) token slots, free
        # variant now; a channel's variants are captured with its decode graphs. Else eager.
        self.verify: VerifyGraphs | None = None
        if verify_width >= 2:
            self.verify = VerifyGraphs(self.gpu, verify_width, self.vocab_size)
            self.verify.attach_channel(None)
        self.num_verify_steps = 0  # verify graph steps (also counted in num_graph_steps)

    def _variants(self, base) -> tuple:
        return tuple(base) + (tuple(with_filters(v) for v in base) if self.filters else ())

    # ---- which path ------------------------------------------------------------------------
    @property
    def max_pages_per_row(self) -> int:
        """Page-table width of the persistent buffers."""
        return self.gpu.buffers.page_table.shape[1]

    def can_graph(self, batch: ScheduledBatch) -> bool:
        """Decode-only rows that the captured step can run as they are, or (verify graphs on)
        rows with drafts that the captured verify step can run. Never a row whose mask came late
        (`Request.late_mask`): a decode graph waits for every row's mask."""
        rows = batch.rows
        max_pages = self.max_pages_per_row
        if any(row.request.late_mask is not None for row in rows):
            return False
        if 0 < len(rows) <= self.gpu.max_batch and all(
                row.is_sampling and len(row.input_ids) == 1 and not row.drafts
                and row.request.sampling.num_logprobs == 0 and len(row.request.pages) <= max_pages
                and not row.request.sampling.uses_logit_processing
                and (self.filters or not row.request.sampling.uses_filters) for row in rows):
            return True
        return self.verify is not None and self.verify.can_run(rows)

    def run(self, batch: ScheduledBatch, fed_back: FedBack | None = None) -> torch.Tensor:
        """(L, vocab) logits of the sampling positions of a batch no graph runs (a mixed step)."""
        self.num_mixed_steps += 1
        return self._mixed_logits(batch.rows, fed_back)

    def _mixed_logits(self, rows: list[ScheduledRow], fed_back: FedBack | None = None) -> torch.Tensor:
        if self.mixed_graphs is not None and self.mixed_graphs.can_run(rows):
            return self.mixed_graphs(rows, fed_back=fed_back)
        return self.mixed(rows, fed_back)

    def token_bucket(self, num_tokens: int) -> int:
        """Mixed steps replay a graph of a bucket's slots: the padding up to it costs what tokens do."""
        return self.mixed_graphs.token_bucket(num_tokens) if self.mixed_graphs is not None else num_tokens

    @property
    def max_step_tokens(self) -> int | None:
        return self.mixed_graphs.max_tokens if self.mixed_graphs is not None else None

    @torch.no_grad()
    def _warm_eager_mixed(self) -> None:
        """Compile the eager mixed step's kernels now (a long prompt beside a decode row, verify
        rows), not in the first step that needs them; every write lands in the dummy page."""
        def row(num_tokens: int, num_drafts: int = 0) -> ScheduledRow:
            ids = [0] * (num_tokens + num_drafts)
            pages = [DUMMY_PAGE] * -(-len(ids) // self.kv_cache.page_size)
            return ScheduledRow(_ProbeRequest(pages), 0, ids, ids[num_tokens:], is_sampling=True)
        self.mixed([row(1), row(2304)])
        self.mixed([row(1), row(1, 4)])
        warm_device_sampler(self.vocab_size, self.device)  # the mixed steps' sampler
        torch.cuda.synchronize()

    @torch.no_grad()
    def measure_step_cost(self) -> MixedStepCost:
        """What steps cost here: the free decode graph's replay time at the largest bucket
        (padding rows: the weight read), and a mixed step's fixed and per-token time from mixed
        steps of one row of 256 and 1,024 tokens. Every K/V write of the probes lands in the
        dummy page."""
        decode_s = _median_s(lambda: self.gpu.step(self.gpu.max_batch))

        def probe(num_tokens: int) -> float:
            row = ScheduledRow(_ProbeRequest([DUMMY_PAGE] * -(-num_tokens // self.kv_cache.page_size)), 0,
                               [0] * num_tokens, is_sampling=True)
            return _median_s(lambda: self._mixed_logits([row]))
        short_s, long_s = probe(256), probe(1024)
        per_token_s = max((long_s - short_s) / 768, 1e-9)
        cost = MixedStepCost(max(short_s - 256 * per_token_s, 0.0), per_token_s, decode_s)
        log.info("step cost: decode step of %d rows %.2f ms, mixed step %.3f ms + %.1f us a token",
                 self.gpu.max_batch, decode_s * 1e3, cost.fixed_s * 1e3, per_token_s * 1e6)
        return cost

    # ---- self-speculative drafts -------------------------------------------------------------
    @torch.inference_mode()
    def draft_logits(self, pages: list[int], new_ids: list[int], num_cached: int,
                     layer_ids: tuple[int, ...]) -> torch.Tensor:
        """A one-row draft through `layer_ids` (self_drafts.py): one replay of a mixed-step graph
        of those layers (DRAFT_TOKEN_BUCKET slots, one row), captured at the first draft with
        them (the calibration is read at the first request that asks for it); a row it does not
        fit runs the same fused layers eagerly. On the engine loop's stream, after every step
        whose tokens it reads."""
        row = ScheduledRow(_ProbeRequest(pages), num_cached, list(new_ids), is_sampling=True)
        graphs = self._drafts_through(tuple(layer_ids))
        if graphs is not None and graphs.can_run([row]):
            return graphs([row])[0]
        return self.mixed([row], layer_ids=tuple(layer_ids))[0]

    def _drafts_through(self, layer_ids: tuple[int, ...]) -> MixedGraphs | None:
        """The draft graph of `layer_ids` (recaptured when they change); None without mixed graphs."""
        if self.mixed_graphs is None:
            return None
        if self._draft_graphs is None or self._draft_graphs.layer_ids != layer_ids:
            if self._draft_graphs is not None:
                self._draft_graphs.close()
            self._draft_graphs = MixedGraphs(self.gpu.forward, 1, self._context_pages, (DRAFT_TOKEN_BUCKET,),
                                             layer_ids=layer_ids)
            self._draft_graphs.capture()
        return self._draft_graphs

    # ---- one graph step ----------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, batch: ScheduledBatch, step: int | None, link=None):
        """Replay one decode step and wait for its tokens: `launch` then `collect`."""
        return self.collect(self.launch(batch, step, link), link)

    @torch.no_grad()
    def launch(self, batch: ScheduledBatch, step: int | None, link=None, chained: bool = False,
               fed_back: FedBack | None = None) -> Launch:
        """Replay one decode step without waiting for it. `step`: the grammar step whose
        descriptor `link.begin(..., gpu=True)` wrote, or None (free step).

        chained=True (overlap): the same rows as the step launched just before, one token
        further. Their input ids, positions and seq_lens are the ones the previous replay fed
        back on the device (its tokens are not known here yet); only page-table entries of
        pages reserved since are written. `fed_back`: rows loaded anew whose input token is the
        step in flight's sample (`FED_BACK_TOKEN`), copied in on the device (mixed_steps.py)."""
        rows = batch.rows
        num_rows = len(rows)
        if step is not None:  # NOTE: before loading: a (re)capture scrubs every row of the buffers
            self._ensure_channel(link, step)
        if not chained and any(row.drafts for row in rows):  # can_graph: a verify batch
            self.verify.load(rows)
            self.verify.step(num_rows, constrained=step is not None)
            self.num_graph_steps += 1
            self.num_verify_steps += 1
            return Launch(step, num_rows, verify=True)
        if chained:
            self._load_new_pages(rows)
            self.num_chained_steps += 1
        else:
            self._load(rows)
            if fed_back is not None:
                fed_back.apply(self.gpu.buffers.input_ids, range(num_rows), self._staging)
        self.gpu.step(num_rows, constrained=step is not None,
                      filters=self.filters and any(row.request.sampling.uses_filters for row in rows))
        self.num_graph_steps += 1
        launched = Launch(step, num_rows)
        if step is None:  # free step: tokens through a pinned copy behind an event
            launched.host_tokens, launched.ready = self._host_tokens[self._next_copy], self._copy_ready[self._next_copy]
            self._next_copy ^= 1
            launched.host_tokens[:num_rows].copy_(self.gpu.buffers.out_tokens[:num_rows], non_blocking=True)
            launched.ready.record()
        return launched

    def step_tokens(self, launched: Launch) -> torch.Tensor | None:
        """The tokens of a launched decode step on the device, in stream order (what a step
        chained after it feeds back, mixed_steps.py), or None (a verify step; or buffers not on a
        CUDA stream)."""
        tokens = self.gpu.buffers.out_tokens
        if launched.verify or tokens.device.type != "cuda":
            return None
        return tokens[:launched.num_rows]

    def stream_channel(self, link) -> DeviceStreamChannel:
        """The link's region as a mixed step's stream sees it (stream_channel.py), registered
        (and the decode graphs captured over it) at the first use, as for a graph step."""
        if link.channel is not self.channel:
            self._ensure_channel(link, link.next_step)
        if self._stream_channel is None or self._stream_channel.mapped is not self._mapped:
            self._stream_channel = DeviceStreamChannel(self._mapped, self.device)
        return self._stream_channel

    def collect(self, launched: Launch, link=None):
        """(samples, StepMasks | None) of a launched step, without a device-wide sync: the
        outputs area after outputs_seq (grammar steps) or this step's copy event (free)."""
        num_rows = launched.num_rows
        if launched.verify:
            return self._collect_verify(launched, link)
        if launched.step is not None:
            masks, tokens = link.wait_gpu(launched.step, num_rows)
        else:
            masks = None
            launched.ready.synchronize()  # this step's copy only, not the whole device
            tokens = launched.host_tokens[:num_rows].tolist()
        return [SampleResult([int(t)]) for t in tokens], masks

    def _collect_verify(self, launched: Launch, link):
        """A verify step's rows: the accepted drafts and the token after them."""
        num_rows = launched.num_rows
        if launched.step is None:
            return [SampleResult(tokens) for tokens in self.verify.free_results(num_rows)], None
        masks, first = link.wait_gpu(launched.step, num_rows)
        if masks is None:
            # NOTE: the watchdog released the step and the link unmapped the region: only the
            # first position's token is known (sampled under all-ones masks; free rows keep
            # it, constrained ones fail), the drafts count as rejected.
            return [SampleResult([int(t)]) for t in first], None
        entry = link.channel.entry(launched.step)  # outputs_seq = step seen: complete
        counts = entry.out_counts[:num_rows].tolist()
        tokens = entry.out_tokens[:num_rows].tolist()
        return [SampleResult(row[:count]) for row, count in zip(tokens, counts)], masks

    def _load(self, rows: list[ScheduledRow]) -> None:
        n = len(rows)
        table = page_table_of([row.request.pages for row in rows])
        self._num_loaded_pages = [len(row.request.pages) for row in rows]
        ids = np.fromiter((row.input_ids[0] for row in rows), dtype=np.int64, count=n).clip(0, self.vocab_size - 1)
        params = [row.request.sampling for row in rows]
        upload = self._staging.upload
        ids, positions, seeds = upload(torch.int64, [
            ids, np.fromiter((row.num_cached for row in rows), dtype=np.int64, count=n),
            np.fromiter((device_seed(row.request.sample_seed) for row in rows), dtype=np.int64, count=n)])
        seq_lens, top_k, flat_table = upload(torch.int32, [
            np.fromiter((row.seq_len for row in rows), dtype=np.int32, count=n),
            np.fromiter((p.top_k for p in params), dtype=np.int32, count=n), table])
        temperature, top_p = upload(torch.float32, [np.fromiter((p.temperature for p in params), dtype=np.float32, count=n),
                                                    np.fromiter((p.top_p for p in params), dtype=np.float32, count=n)])
        self.gpu.load_rows(ids, positions, seq_lens, flat_table.view(table.shape))
        self.gpu.load_sampling(0, temperature, seeds, top_k, top_p)

    def _load_new_pages(self, rows: list[ScheduledRow]) -> None:
        """Page-table entries of pages the rows got since they were loaded (a chained step)."""
        index_rows, index_cols, pages = [], [], []
        for r, row in enumerate(rows):
            have = row.request.pages
            for col in range(self._num_loaded_pages[r], len(have)):
                index_rows.append(r)
                index_cols.append(col)
                pages.append(have[col])
            self._num_loaded_pages[r] = len(have)
        if pages:
            table = self.gpu.buffers.page_table
            table[torch.tensor(index_rows, device=table.device), torch.tensor(index_cols, device=table.device)] = (
                torch.tensor(pages, dtype=table.dtype, device=table.device))

    # ---- the step channel ----------------------------------------------------------------------
    @torch.no_grad()
    def attach(self, link) -> None:
        """Attach the link's step channel and capture its graphs now (engine start) instead of
        in the first constrained step, which would stall its rows for the whole capture (every
        decode and verify variant: seconds).
        A later step of the link only checks it."""
        if link is not None and link.is_connected:
            self._ensure_channel(link, link.next_step)

    def _ensure_channel(self, link, step: int) -> None:
        channel = link.channel
        if channel is not self.channel:
            from step_channel.cuda import MappedChannel
            if self.channel is not None:
                self.release_channel(self.channel)
            # NOTE: the graphs wait on the parity of mask_seq; a fresh region starts at 0, which
            # has the parity of an even first step: start it at step - 1 so the wait holds.
            if not seq_reached(channel.load_seq("mask_seq"), step - 1):
                channel.publish_seq("mask_seq", step - 1)
            self._mapped = MappedChannel.register(channel)
            self.channel = channel
            link.before_close = self.release_channel
            self.gpu.attach_channel(self._mapped, self._variants(SERVING_VARIANTS), step)
            if self.verify is not None:
                self.verify.attach_channel(self._mapped)
            log.info("decode graphs captured over step channel %s in %.2f s", channel.name,
                     self.gpu.graphs.capture_s)
        elif self.gpu.next_channel_step != step:  # host-side grammar steps ran in between
            self.gpu.set_channel_step(step)

    @torch.no_grad()
    def release_channel(self, channel, recapture: bool = True) -> None:
        """Before `channel` is unmapped: drop the graphs over it, recapture the free ones,
        unregister it (graphs -> synchronize -> unregister -> unmap)."""
        if channel is not self.channel:
            return
        if recapture:
            self.gpu.attach_channel(None, self._variants((FREE,)), self.gpu.next_channel_step)
            if self.verify is not None:
                self.verify.attach_channel(None)
        else:
            self.gpu.close()  # synchronizes before it resets the graphs
            if self.verify is not None:
                self.verify.close()
        self._mapped.close()
        self._mapped, self.channel, self._stream_channel = None, None, None

    def close(self) -> None:
        """Engine stop, after the loop ended and before the link closes its region."""
        for graphs in (self.mixed_graphs, self._draft_graphs):
            if graphs is not None:
                graphs.close()
        if self.channel is not None:
            self.release_channel(self.channel, recapture=False)
        self.gpu.close()
        if self.verify is not None:
            self.verify.close()
