"""MixedSteps: pipelined and chained mixed steps (EngineConfig.pipeline_mixed, docs/serving.md).

A mixed step (prefill chunks beside decode rows, engine.py) is *launched* and left in flight:
its forward is queued, its masks awaited, its sampler queued with the tokens copied to the
host behind an event (`Sampler.launch`). The next engine step then, when it can, *chains*:

    1. schedule step N+1 before N's tokens are known: every row that samples in N goes on
       decoding with `FED_BACK_TOKEN` (the runner copies N's token in on the device,
       `FedBack`), prefill chunks and new requests take the rest of the budget;
    2. launch N+1's forward (queued behind N's sampler: the GPU does not wait for the host);
    3. read N's tokens and accept them (what the scheduler and the channel need), publish
       them to grammar_service, begin N+1's grammar step;
    4. deliver N's tokens (detokenize, stop strings, stream events) while the GPU computes;
    5. wait for N+1's masks and launch its sampler: N+1 is in flight.

so the host work of a step hides behind the next forward. A row that N finishes (a stop
token, grammar completion, a stop string found in 4) has one token too many computed in N+1:
it is dropped (its request is finished). Rows whose token in N is their last, past their
deadline, or whose mask was late (VALID_LATE) are left out of N+1 and come back, if at all,
through the scheduler once N is read; so is a row whose mask came late once (a slow grammar:
its next fill starts once N's token is known, and it sits out until that is likely done,
late_mask.py). With no prefill left beside the decode rows, N+1 is a decode graph step whose
rows are loaded anew and fed N's tokens on the device the same way (`_launch_graph`: free rows
only). A step that cannot chain (a row with drafts, logprobs or logits processing; constrained
rows with no prefill; a page that cannot be reserved without preemption) reads N first: then
N's delivery follows the next step's launch instead (`pipelined`, the same order one step later).

A free decode graph step N in flight whose rows change (one ends, a request arrives or
joins; engine.py `_step_chained`) chains the same way (`launch_after_graph`): the scheduler
makes N+1 with N's rows fed back, a mixed step or a decode graph step, and N is read after
it is launched. Read first, N would leave the GPU idle while the host accepts it and
schedules N+1, and at high concurrency a row ends or a request arrives nearly every step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from generation_service.engine.fed_back import FED_BACK_TOKEN, FedBack
from generation_service.engine.grammar_link import LinkRow, StepMasks
from generation_service.engine.request import RequestStatus
from generation_service.engine.sample_row import SampleRow, all_plain_greedy
from generation_service.engine.sampler import SampleLaunch
from generation_service.engine.scheduler import ScheduledBatch, ScheduledRow
from step_channel import VALID_LATE


@dataclass
class MixedFlight:
    """A launched mixed step whose tokens have not been read."""

    batch: ScheduledBatch     # its rows that sample (and prefill chunks), requests live at launch
    step: int | None          # its grammar step
    rows: list[LinkRow]       # that step's descriptor rows
    masks: StepMasks | None
    sample: SampleLaunch


class MixedSteps:
    """The engine's mixed steps under `pipeline_mixed`; `in_flight` is the launched one.
    `engine`: the Engine whose lock, table, scheduler, runner, sampler and link it drives."""

    def __init__(self, engine, chain: bool) -> None:
        self.engine = engine
        self.chain = chain          # launch N+1 before reading N where the step allows it
        self.in_flight: MixedFlight | None = None
        self.num_chained = 0        # steps launched before their predecessor was read
        self.num_after_graph = 0    # of them, those whose predecessor was a decode graph step
        self.num_into_graph = 0     # decode graph steps launched before the step they follow was read
        self._fed_sources: dict[int, int] = {}  # the chained batch's row -> its previous sample

    def launch(self, batch: ScheduledBatch, fed_back: FedBack | None = None,
               read_previous: Callable[[], None] | None = None) -> None:
        """Launch `batch` (fed back from the step in flight, a chained step), read that step
        (`read_previous`), and leave `batch` in flight (the module's steps 2-5)."""
        engine = self.engine
        started = time.perf_counter()
        logits = engine.runner.run(batch, fed_back)
        for row in batch.rows:  # computed once the stream gets there: what the scheduler sees next
            row.request.num_cached = row.seq_len
        if read_previous is not None:
            read_previous()
            self.num_chained += 1
        with engine.lock:
            live = ScheduledBatch([row for row in batch.rows if not row.request.is_finished])
            rows = engine.table.grammar_rows(live, engine.link)
            step = engine.link.begin(rows) if rows else None
            engine.deliver_deferred()
        if engine.link is not None:
            engine.link.forward_done(step, time.perf_counter() - started)
        masks = engine.link.wait(step) if step is not None else None
        sample = self._launch_sample(live, batch, logits, masks)
        self.in_flight = MixedFlight(live, step, rows, masks, sample)
        engine.num_mixed_steps += 1
        engine.num_prefill_tokens += batch.num_prefill_tokens

    def step(self) -> None:
        """The engine step after a launched one: chain the next, or read this one."""
        engine, previous = self.engine, self.in_flight
        self.in_flight = None
        with engine.lock:
            engine.apply_inbox()
            engine.table.poll(engine.link)
            batch = self._chained_batch(previous) if self.chain else None
        read_previous = lambda: self.collect(previous)  # noqa: E731
        if batch is None or self._launch_chained(batch, previous.sample.tokens, read_previous) is None:
            self.collect(previous)

    def launch_after_graph(self, rows: list[ScheduledRow], tokens: torch.Tensor,
                           read_previous: Callable[[], None]) -> Literal["mixed", "graph"] | None:
        """Chain the next step after a free decode graph step in flight, whose `rows` sample
        `tokens` (on the device): "mixed" or "graph", the step launched (and the graph step
        read), or None (nothing changed but pages reserved: the caller reads it first)."""
        engine = self.engine
        if not self.chain:
            return None
        with engine.lock:
            engine.apply_inbox()
            engine.table.poll(engine.link)
            for row in rows:  # computed once the stream gets there: what the scheduler sees next
                row.request.num_cached = max(row.request.num_cached, row.seq_len)
            batch = self._batch_after(rows, {})
        kind = self._launch_chained(batch, tokens, read_previous) if batch is not None else None
        if kind == "mixed":
            self.num_after_graph += 1
        return kind

    def _launch_chained(self, batch: ScheduledBatch, tokens: torch.Tensor | None,
                        read_previous: Callable[[], None]) -> Literal["mixed", "graph"] | None:
        """Launch `batch`, scheduled with the rows of the step in flight fed back (`tokens`):
        a mixed step if it prefills, else a decode graph where one can run it; which, or None
        (nothing launched)."""
        if batch.num_prefill_tokens:
            self.launch(batch, FedBack(tokens, self._fed_sources), read_previous)
            return "mixed"
        return "graph" if self._launch_graph(batch, tokens, read_previous) else None

    def _launch_graph(self, batch: ScheduledBatch, tokens: torch.Tensor | None,
                      read_previous: Callable[[], None]) -> bool:
        """Decode rows alone after the step in flight: a decode graph fed its `tokens` on the
        device (the engine's step in flight), launched before that step is read and delivered;
        whether it could (free rows the graph runs, tokens on a CUDA stream)."""
        engine = self.engine
        if (tokens is None or tokens.device.type != "cuda" or engine.table.pending_release
                or (engine.held is not None and engine.held.wants_host_step)
                or any(row.request.is_constrained for row in batch.rows) or not engine.runner.can_graph(batch)):
            return False
        engine.launch_graph(batch, FedBack(tokens, self._fed_sources))
        read_previous()
        with engine.lock:
            engine.deliver_deferred()
        self.num_into_graph += 1
        return True

    def collect(self, flight: MixedFlight) -> None:
        """Read a launched step's tokens and accept them; their delivery is deferred."""
        self.engine.finish_step(flight.batch, flight.step, flight.sample.result(), flight.masks, False,
                                flight.rows, defer=True)

    def _launch_sample(self, live: ScheduledBatch, batch: ScheduledBatch, logits: torch.Tensor,
                       masks: StepMasks | None) -> SampleLaunch:
        """Sample the rows of `live`, whose logits are those of `batch`'s sampling rows that
        are still live (a request that the previous step finished is not sampled)."""
        rows, every = live.sampling_rows, batch.sampling_rows
        if len(rows) != len(every):
            index, offset = [], 0
            for row in every:
                if not row.request.is_finished:
                    index.extend(range(offset, offset + row.num_positions))
                offset += row.num_positions
            engine = self.engine
            logits = logits.index_select(0, engine.sampler.staging(logits.device).tensor(torch.int64, index)) \
                if logits.device.type == "cuda" else logits[index]
        if all_plain_greedy(rows):  # (the argmax needs nothing per row: no SampleRow, no draw arguments)
            return self.engine.sampler.launch_greedy(logits)
        sample_rows = [SampleRow.of(row, row.request.is_constrained and masks is not None) for row in rows]
        return self.engine.sampler.launch(logits, sample_rows, masks.bitmask if masks is not None else None)

    def _chained_batch(self, previous: MixedFlight) -> ScheduledBatch | None:
        """Step N+1 scheduled before `previous`'s tokens are read, or None (read N first)."""
        if previous.sample.tokens is None:
            return None
        return self._batch_after(previous.batch.sampling_rows,
                                 previous.masks.valid_positions if previous.masks is not None else {})

    def _batch_after(self, sampling_rows: list[ScheduledRow], valid_positions: dict[int, int]) -> ScheduledBatch | None:
        """The chained step after one whose `sampling_rows` sample a token each, or None."""
        engine = self.engine
        if engine.link is not None and not engine.link.is_connected:
            return None  # let `poll` reconnect and fail what needs the grammar, once N is read
        # NOTE: what every row reads is looked up once: this loop runs per row per step
        # (benchmarks/results/engine_host_mixed-ci-2core-chain.json)
        now = time.monotonic()
        may_draft = bool(engine.config.max_draft_tokens)
        reserve = engine.scheduler.reserve
        continuing, sources = [], {}
        for index, row in enumerate(sampling_rows):
            request = row.request
            spec = request.spec
            sampling = spec.sampling
            if (sampling.num_logprobs or sampling.uses_logit_processing
                    or (may_draft and spec.speculative.num_draft_tokens)):
                return None  # the sampler's CPU rules, or drafts: scheduled once N is read
            if (request.status is not RequestStatus.RUNNING
                    or request.num_generated + 1 >= sampling.max_new_tokens  # N's token is its last
                    or (spec.deadline is not None and now > spec.deadline)
                    or (spec.grammar is not None and valid_positions.get(id(request), 1) in (0, VALID_LATE))
                    or request.late_mask is not None):  # a slow row: its next mask is not ready yet (late_mask.py)
                continue
            seq_len = row.seq_len
            if not reserve(request, seq_len + 1):
                return None  # (pages reserved before a refusal are kept for the next step)
            sources[len(continuing)] = index  # the continuing rows come first in the batch
            continuing.append(ScheduledRow(request, seq_len, [FED_BACK_TOKEN], is_sampling=True))
        if not continuing:
            return None
        self._fed_sources = sources
        return engine.scheduler.schedule(0, continuing=continuing)
