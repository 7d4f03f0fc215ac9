"""One verify step alone, for benchmarks/verify.py's `step` rows.

On an idle engine (its pages all free), `idle_rows` builds `batch` requests at a given context
with rows x (1 + drafts) verify tokens, and the same rows without drafts (one plain decode
token each); `step_costs` times, per batch, the host wall time (`median_ms` of `reps` calls
after a warm-up) of the verify graph (launch + collect), the eager verify (ModelRunner.run +
the Sampler: what Engine.step does for a batch it does not graph), the eager forward alone,
and one decode graph step of the same rows; without graphs (runner "eager") the eager figures
only. `num` formats a figure that may be None. Assumes verify.py has put the repository root
and benchmarks/ on sys.path.
"""

from __future__ import annotations

import statistics
import time

import torch

from generation_service.engine.engine import Engine
from generation_service.engine.kv_cache import num_pages_for
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from generation_service.engine.request import Request
from generation_service.engine.sample_row import SampleRow
from generation_service.engine.scheduler import ScheduledBatch, ScheduledRow

from tests.integration.test_engine_support import wait_settled

from benchmarks._harness import log


def num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def idle_rows(engine: Engine, batch: int, context: int, num_drafts: int, gen: torch.Generator):
    """(verify rows, the same rows without drafts, their pages): `batch` requests at `context`
    cached tokens (random ids; K/V whatever the pages hold), pages from the idle engine."""
    vocab, width = engine.model_config.vocab_size, 1 + num_drafts
    verify, decode, pages = [], [], []
    for i in range(batch):
        ids = torch.randint(0, vocab, (context + width,), generator=gen).tolist()
        request = Request(GenerationRequest(f"step-{i}", tuple(ids[:context + 1]),
                                            SamplingParams(max_new_tokens=width, ignore_eos=True),
                                            speculative=SpeculativeParams(num_drafts)), frozenset(), i)
        request.pages = engine.allocator.allocate(num_pages_for(context + width, engine.config.page_size))
        request.num_cached = context
        pages += request.pages
        verify.append(ScheduledRow(request, context, ids[context:], ids[context + 1:], is_sampling=True))
        decode.append(ScheduledRow(request, context, ids[context:context + 1], is_sampling=True))
    return ScheduledBatch(verify), ScheduledBatch(decode), pages


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median host wall time of fn (which ends synchronized), after warmup calls."""
    times = []
    for _ in range(warmup + reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]) * 1e3


def step_costs(engine: Engine, preset: str, batches: list[int], context: int, num_drafts: int,
               reps: int) -> list[dict]:
    """One step alone per batch (module docstring); without graphs (runner "eager") the eager
    figures only."""
    wait_settled(engine)  # every page back: the rows below take theirs from the allocator
    runner, sampler = engine.runner, engine.sampler
    has_graphs = getattr(runner, "verify", None) is not None
    gen, out = torch.Generator().manual_seed(1), []

    def synchronize() -> None:
        if runner.device.type == "cuda":
            torch.cuda.synchronize()

    def eager_step(batch: ScheduledBatch, sample: bool = True) -> None:  # Engine.step's eager path (no masks)
        logits = runner.run(batch)
        if sample:
            sampler(logits, [SampleRow.of(row, False) for row in batch.rows])
        synchronize()

    def graph_step(batch: ScheduledBatch) -> None:  # verify rows: the verify graph; else a decode graph
        runner.collect(runner.launch(batch, None))

    for batch_size in batches:
        verify, decode, pages = idle_rows(engine, batch_size, context, num_drafts, gen)
        try:
            row = {"preset": preset, "batch": batch_size, "context": context, "num_draft_tokens": num_drafts,
                   "graph_ms": median_ms(lambda: graph_step(verify), reps) if has_graphs else None,
                   "eager_ms": median_ms(lambda: eager_step(verify), reps),
                   "eager_forward_ms": median_ms(lambda: eager_step(verify, sample=False), reps),
                   "decode_graph_ms": median_ms(lambda: graph_step(decode), reps) if has_graphs else None}
        finally:
            engine.allocator.free(pages)
        if has_graphs:
            row["eager_over_graph"] = row["eager_ms"] / row["graph_ms"]
            row["graph_over_decode"] = row["graph_ms"] / row["decode_graph_ms"]
        log(f"{preset} b={batch_size:3d} one verify step: graph {num(row['graph_ms'], '.3f')} ms, eager "
            f"{row['eager_ms']:.3f} ms (forward {row['eager_forward_ms']:.3f}), decode graph "
            f"{num(row['decode_graph_ms'], '.3f')} ms")
        out.append(row)
    return out
