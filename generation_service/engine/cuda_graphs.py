"""Persistent decode buffers and the CUDA graphs captured over them (docs/gpu.md).

One graph per (batch bucket, variant). A step of B rows replays the graph of the smallest
bucket >= B; rows B..bucket-1 are padding: `DecodeBuffers.scrub_tail` points them at the
dummy page 0 with seq_len 0 and token id 0 before every replay, so whatever they compute
lands in the dummy page and never in a live request's pages.

Variants (`GraphVariant`):
- ``free``             no step-channel work at all (a batch without constrained rows);
- ``wait_even/odd``    publish inputs_seq, forward, wait for mask_seq, apply masks, sample,
                       write outputs + outputs_seq. Two copies because the wait value of a
                       captured ``cuStreamWaitValue32`` is fixed at capture: see
                       `step_channel_wait` below and docs/gpu.md;
- ``nowait``           mask gather/apply and outputs-area writes without the wait and
                       without the sequence words (benchmarks: isolates the wait's cost;
                       grammar_service sees nothing of these steps);
- ``prepublished``     a channel step whose wait always passes (``WAIT_GEQ 0``): the whole
                       mechanism of ``wait_*`` without waiting for grammar_service
                       (benchmarks only: it breaks the parity invariant, see benchmarks/decode.py).
Each channel variant reads its masks on a side stream while the forward runs (mask
prefetch, gpu_runner.py) unless it is the ``+serial`` twin (wait and gather after the
forward, on the one stream). Each variant has a ``+filters`` twin whose sampler keeps
top-k/top-p (mask_sample's ``enable_filters``); batches where no row uses them replay the
plain, cheaper one.

Capture: largest bucket first, all graphs into one memory pool (the big graph's blocks are
reused by the small ones; graphs never run concurrently and their results live in the
persistent buffers, not in the pool). A body may fork work onto other streams
(`GpuDecodeRunner`'s mask prefetch): those streams join the capture stream before the body
returns, so they become parallel branches of the one graph and a replay ends only when
every branch has.

Teardown order (NOTE: reversing it can fault a replay or leak pinned memory):
`DecodeGraphs.close()` (graphs reset, pool dropped) -> synchronize ->
`MappedChannel.close()` (unregister) -> `StepChannel.close()` (unmap, unlink).
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from generation_service.engine.kv_cache import DUMMY_PAGE

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def bucket_for(batch_size: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= batch_size (buckets sorted ascending)."""
    index = bisect.bisect_left(buckets, batch_size)
    if batch_size < 1 or index == len(buckets):
        raise ValueError(f"batch size {batch_size} outside the captured buckets {buckets}")
    return buckets[index]


@dataclass(frozen=True)
class GraphVariant:
    """What a captured step does besides the forward. `name` (the graph's key) is derived."""

    kind: str               # free | wait_even | wait_odd | nowait | prepublished
    uses_channel: bool      # applies the entry's masks, writes the entry's outputs
    waits: bool             # publishes inputs_seq/outputs_seq, waits for mask_seq: a channel step
    parity: int | None = None  # the step parity this copy's baked wait accepts (None: any step)
    filters: bool = False   # the sampler applies top-k/top-p (else compiled out)
    serial: bool = False    # masks waited for and gathered after the forward (no prefetch)

    @property
    def name(self) -> str:
        return self.kind + ("+serial" if self.serial else "") + ("+filters" if self.filters else "")

    @property
    def prefetches(self) -> bool:
        """Masks are waited for and gathered on the side stream while the forward runs."""
        return self.uses_channel and not self.serial

    @staticmethod
    def for_step(constrained: bool, step: int, wait: bool = True, filters: bool = False,
                 prefetch: bool = True) -> "GraphVariant":
        if not constrained:
            variant = FREE
        elif not wait:
            variant = NOWAIT
        else:
            variant = WAIT_ODD if step & 1 else WAIT_EVEN
        if not prefetch:
            variant = with_serial(variant)
        return with_filters(variant) if filters else variant


FREE = GraphVariant("free", uses_channel=False, waits=False)
WAIT_EVEN = GraphVariant("wait_even", uses_channel=True, waits=True, parity=0)
WAIT_ODD = GraphVariant("wait_odd", uses_channel=True, waits=True, parity=1)
NOWAIT = GraphVariant("nowait", uses_channel=True, waits=False)
PREPUBLISHED = GraphVariant("prepublished", uses_channel=True, waits=True, parity=None)
SERVING_VARIANTS = (FREE, WAIT_EVEN, WAIT_ODD)


def with_filters(variant: GraphVariant) -> GraphVariant:
    """The twin of `variant` whose sampler applies top-k/top-p."""
    return replace(variant, filters=True)


def with_serial(variant: GraphVariant) -> GraphVariant:
    """The twin of `variant` that reads its masks after the forward (a free variant reads none)."""
    return replace(variant, serial=True) if variant.uses_channel else variant


@dataclass
class DecodeBuffers:
    """Inputs and outputs a captured decode step reads and writes; allocated once, max size.

    Row r of every tensor is batch row r. The graph of bucket b reads rows [0, b).
    """

    input_ids: torch.Tensor    # (max_batch,) int64 token fed at this step
    positions: torch.Tensor    # (max_batch,) int64 its absolute position
    seq_lens: torch.Tensor     # (max_batch,) int32 tokens in cache after this step (0 = padding)
    page_table: torch.Tensor   # (max_batch, max_pages) int32 page ids (0 = dummy page)
    out_tokens: torch.Tensor   # (max_batch,) int64 sampled tokens of the last step
    step: torch.Tensor         # (1,) int32 channel step N of the next channel replay
    ring_slot: torch.Tensor    # (1,) int64 N % depth
    live: torch.Tensor = field(init=False)  # scratch (max_batch,) int32, seq_lens > 0

    def __post_init__(self) -> None:
        self.live = torch.zeros_like(self.seq_lens)

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, device) -> "DecodeBuffers":
        z = lambda *shape, dtype: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        return cls(input_ids=z(max_batch, dtype=torch.int64), positions=z(max_batch, dtype=torch.int64),
                   seq_lens=z(max_batch, dtype=torch.int32),
                   page_table=z(max_batch, max_pages, dtype=torch.int32),
                   out_tokens=z(max_batch, dtype=torch.int64), step=z(1, dtype=torch.int32),
                   ring_slot=z(1, dtype=torch.int64))

    @property
    def max_batch(self) -> int:
        return self.input_ids.shape[0]

    def set_rows(self, start: int, input_ids: torch.Tensor, positions: torch.Tensor,
                 seq_lens: torch.Tensor, page_table: torch.Tensor) -> None:
        """Host update of rows [start, start+n) (async copies; tensors may live on the host)."""
        n = input_ids.shape[0]
        self.input_ids[start:start + n].copy_(input_ids, non_blocking=True)
        self.positions[start:start + n].copy_(positions, non_blocking=True)
        self.seq_lens[start:start + n].copy_(seq_lens, non_blocking=True)
        self.page_table[start:start + n].zero_()
        self.page_table[start:start + n, :page_table.shape[1]].copy_(page_table, non_blocking=True)

    def scrub_tail(self, batch_size: int, bucket: int) -> None:
        """Rows [batch_size, bucket) become padding: token 0, position 0, seq_len 0, dummy page."""
        if batch_size < bucket:
            self.input_ids[batch_size:bucket].zero_()
            self.positions[batch_size:bucket].zero_()
            self.seq_lens[batch_size:bucket].zero_()
            self.page_table[batch_size:bucket].fill_(DUMMY_PAGE)

    def set_step(self, step: int, depth: int) -> None:
        """Host sets the channel step counter (first channel step, after a reconnect)."""
        self.step.fill_(step & 0x7FFFFFFF)
        self.ring_slot.fill_(step % depth)


StepBody = Callable[[int, GraphVariant], None]


class DecodeGraphs:
    """CUDA graphs of one step body over buckets x variants, sharing one memory pool."""

    def __init__(self, body: StepBody, buckets: tuple[int, ...], variants: tuple[GraphVariant, ...],
                 device) -> None:
        self.body = body
        self.buckets = tuple(sorted(buckets))
        self.variants = variants
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.pool = None
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0

    def capture(self, warmup: Callable[[int], None]) -> None:
        """Capture every (bucket, variant), largest bucket first, into one pool.

        ``warmup(bucket)`` runs the free body eagerly once per bucket first (Triton compiles,
        cuBLAS picks its kernels and workspace) -- never a waiting variant, which would block.
        """
        start = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        for bucket in sorted(self.buckets, reverse=True):
            with torch.cuda.stream(self.stream):
                warmup(bucket)
            self.stream.synchronize()
            for variant in self.variants:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    self.body(bucket, variant)
                self.graphs[(bucket, variant.name)] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        log.info("captured %d decode graphs in %.2f s", len(self.graphs), self.capture_s)

    def replay(self, bucket: int, variant: GraphVariant) -> None:
        self.graphs[(bucket, variant.name)].replay()

    def close(self) -> None:
        """Destroy the graphs and drop the pool. Before unregistering the step channel."""
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = None


def capture_graphs(owner, buckets: tuple[int, ...], variants: tuple[GraphVariant, ...]) -> DecodeGraphs:
    """`owner.body` captured over buckets x variants after `owner.warmup`, with
    `owner._capturing` set meanwhile (the body issues channel memops only when capturing)."""
    graphs = DecodeGraphs(owner.body, buckets, variants, owner.device)
    owner._capturing = True
    try:
        graphs.capture(owner.warmup)
    finally:
        owner._capturing = False
    return graphs
