"""MixedSteps: pipelined and chained mixed steps (EngineConfig.pipeline_mixed, docs/serving.md).

A mixed step (prefill chunks beside decode rows, engine.py) is *launched* and left in flight:
its forward and its sampler are queued, the tokens copied to the host behind an event
(`Sampler.launch`). The next engine step then, when it can, *chains*:

    1. schedule step N+1 before N's tokens are known: every row that samples in N goes on
       decoding with `FED_BACK_TOKEN` (the runner copies N's token in on the device,
       `FedBack`), prefill chunks and new requests take the rest of the budget;
    2. write N+1's descriptor and launch it whole (stream_channel.py): inputs_seq = N+1, the
       forward, the wait for N+1's masks, the sampler, N+1's outputs and outputs_seq, all queued
       behind N on the device, so grammar_service advances on N's tokens and fills N+1's masks
       while the GPU computes N+1's forward, with the host nowhere in between;
    3. read N's tokens and its grammar results after outputs_seq = N (`GrammarLink.wait_gpu`)
       and accept them (what the scheduler needs);
    4. deliver N's tokens (detokenize, stop strings, stream events) while the GPU computes.

so the host work of a step hides behind the next forward, for constrained rows as for free
ones. A row that N finishes (a stop token, grammar completion, a stop string found in 4) has one
token too many computed in N+1: it is dropped (its request is finished), and its matcher, which
advanced by it, is released with the request. Rows whose token in N is their last or past their
deadline are left out of N+1 and come back, if at all, through the scheduler once N is read.
With no prefill left beside the decode rows, N+1 is a decode graph step whose rows are loaded
anew and fed N's tokens on the device the same way (`_launch_graph`).

Host grammar steps: a step whose rows need the host (drafts, logprobs, logits processing, a row
whose mask came late once, late_mask.py, or a host step the held-graph probe asked for) waits for
its masks on the host after its forward and publishes its tokens from the host once read, so a
slow grammar can be late there (VALID_LATE) instead of holding the step. Such a step is not
launched while a step in stream order is unread, nor one in stream order while a host grammar
step's tokens are unpublished: inputs_seq = N+1 promises N's outputs. A step that cannot chain
(drafts, logprobs, logits processing; a page that cannot be reserved without preemption) reads N
first: then N's delivery follows the next step's launch instead (`pipelined`).

A decode graph step N in flight whose rows change (one ends, a request arrives or joins;
engine.py `_step_chained`) chains the same way (`launch_after_graph`): the scheduler makes N+1
with N's rows fed back, a mixed step or a decode graph step, and N is read after it is launched.
Read first, N would leave the GPU idle while the host accepts it and schedules N+1, and at high
concurrency a row ends or a request arrives nearly every step.
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
from generation_service.engine.sampler import SampleLaunch, SampleResult
from generation_service.engine.scheduler import ScheduledBatch, ScheduledRow
from generation_service.engine.stream_channel import StreamChannel
from step_channel import VALID_LATE


@dataclass
class MixedFlight:
    """A launched mixed step whose tokens have not been read."""

    batch: ScheduledBatch     # its rows that sample (and prefill chunks), requests live at launch
    step: int | None          # its grammar step
    rows: list[LinkRow]       # that step's descriptor rows
    masks: StepMasks | None   # a host grammar step's masks (read at launch)
    sample: SampleLaunch
    in_stream: bool = False   # its grammar step runs in stream order: tokens and results from the channel

    @property
    def is_host_grammar(self) -> bool:
        """A grammar step whose tokens the host publishes once it reads them."""
        return self.step is not None and not self.in_stream


class MixedSteps:
    """The engine's mixed steps under `pipeline_mixed`; `in_flight` is the launched one.
    `engine`: the Engine whose lock, table, scheduler, runner, sampler and link it drives."""

    def __init__(self, engine, chain: bool) -> None:
        self.engine = engine
        self.chain = chain          # launch N+1 before reading N where the step allows it
        self.in_flight: MixedFlight | None = None
        self.num_chained = 0        # steps launched before their predecessor was read
        self.num_chained_grammar = 0  # of them, grammar steps in stream order (constrained rows chained)
        self.num_after_graph = 0    # of them, those whose predecessor was a decode graph step
        self.num_into_graph = 0     # decode graph steps launched before the step they follow was read
        self._fed_sources: dict[int, int] = {}  # the chained batch's row -> its previous sample

    def launch(self, batch: ScheduledBatch, fed_back: FedBack | None = None,
               read_previous: Callable[[], None] | None = None, after_host_grammar: bool = False) -> None:
        """Launch `batch` (fed back from the step in flight, a chained step), read that step
        (`read_previous`), and leave `batch` in flight (the module's steps 2-4).
        after_host_grammar: the step in flight is a host grammar step (its tokens unpublished)."""
        channel = None if after_host_grammar else self._stream_channel(batch)
        if channel is None:
            self._launch_host(batch, fed_back, read_previous)
            return
        engine = self.engine
        with engine.lock:
            rows = engine.table.grammar_rows(batch, engine.link)
            step = engine.link.begin(rows, gpu=True) if rows else None
        if step is not None:  # NOTE: in stream order after N's outputs: the promise inputs_seq makes
            channel.publish_inputs(step)
        logits = engine.runner.run(batch, fed_back)
        for row in batch.rows:  # computed once the stream gets there: what the scheduler sees next
            row.request.num_cached = row.seq_len
        sample = self._sample_in_stream(batch, logits, channel, step)
        if read_previous is not None:
            read_previous()
            self.num_chained += 1
            self.num_chained_grammar += step is not None
        self.in_flight = MixedFlight(batch, step, rows, None, sample, in_stream=True)
        with engine.lock:
            engine.deliver_deferred()
        engine.num_mixed_steps += 1
        engine.num_prefill_tokens += batch.num_prefill_tokens

    def _launch_host(self, batch: ScheduledBatch, fed_back: FedBack | None,
                     read_previous: Callable[[], None] | None) -> None:
        """A host grammar step: its forward queued, the step in flight read, then its masks
        awaited on the host (a slow row may be late) and its sampler launched."""
        engine = self.engine
        if engine.held is not None:
            engine.held.host_step()
        started = time.perf_counter()
        logits = engine.runner.run(batch, fed_back)
        for row in batch.rows:
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

    def _stream_channel(self, batch: ScheduledBatch) -> StreamChannel | None:
        """Where `batch`'s grammar step runs in stream order, or None: a host grammar step."""
        engine = self.engine
        link = engine.link
        if link is None or not link.is_connected or (engine.held is not None and engine.held.wants_host_step):
            return None
        for row in batch.sampling_rows:
            sampling = row.request.sampling
            if row.drafts or sampling.num_logprobs or sampling.uses_logit_processing or row.request.late_mask:
                return None
        return engine.runner.stream_channel(link)

    def _sample_in_stream(self, batch: ScheduledBatch, logits: torch.Tensor, channel: StreamChannel,
                          step: int | None) -> SampleLaunch:
        """Sample `batch` behind its forward; a grammar step first waits for its masks and then
        publishes the tokens (every grammar step waits: a decode graph's parity wait after it
        relies on mask_seq having reached it, gpu_runner.py)."""
        rows = batch.sampling_rows
        sampler = self.engine.sampler
        masks = channel.masks(step, len(rows)) if step is not None else None
        if not rows:
            sample = SampleLaunch([], torch.zeros(0, dtype=torch.int64, device=logits.device))
        elif all_plain_greedy(rows):
            sample = sampler.launch_greedy(logits)
        else:
            sample = sampler.launch(logits, [SampleRow.of(row, row.request.is_constrained and masks is not None)
                                             for row in rows], masks)
        if step is not None:
            channel.publish_outputs(step, sample.tokens)
        return sample

    def step(self) -> None:
        """The engine step after a launched one: chain the next, or read this one."""
        engine, previous = self.engine, self.in_flight
        self.in_flight = None
        with engine.lock:
            engine.apply_inbox()
            engine.table.poll(engine.link)
            batch = self._chained_batch(previous) if self.chain else None
        read_previous = lambda: self.collect(previous)  # noqa: E731
        if batch is not None and previous.is_host_grammar and self._stream_channel(batch) is not None:
            # read first: N's tokens published, N+1's grammar step runs in stream order (chained
            # after a host grammar step, N+1 would be one too, and so on while the chain lasts)
            self.collect(previous)
            read_previous = None
            batch = self._without_finished(batch)
        if batch is None or self._launch_chained(batch, previous.sample.tokens, read_previous,
                                                 previous.is_host_grammar and read_previous is not None) is None:
            if read_previous is not None:
                self.collect(previous)

    def _without_finished(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """`batch` less the rows of requests that the step read since it was scheduled ended
        (their feed-back sources kept for the others), or None if none is left."""
        if not any(row.request.is_finished for row in batch.rows):
            return batch
        rows, sources = [], {}
        for index, row in enumerate(batch.rows):
            if not row.request.is_finished:
                if index in self._fed_sources:
                    sources[len(rows)] = self._fed_sources[index]
                rows.append(row)
        self._fed_sources = sources
        return ScheduledBatch(rows) if rows else None

    def launch_after_graph(self, rows: list[ScheduledRow], tokens: torch.Tensor,
                           read_previous: Callable[[], None]) -> Literal["mixed", "graph"] | None:
        """Chain the next step after a decode graph step in flight, whose `rows` sample `tokens`
        (on the device): "mixed" or "graph", the step launched (and the graph step read), or
        None (nothing changed but pages reserved: the caller reads it first)."""
        engine = self.engine
        if not self.chain:
            return None
        with engine.lock:
            engine.apply_inbox()
            engine.table.poll(engine.link)
            for row in rows:  # computed once the stream gets there: what the scheduler sees next
                row.request.num_cached = max(row.request.num_cached, row.seq_len)
            batch = self._batch_after(rows, {})
        kind = self._launch_chained(batch, tokens, read_previous, False) if batch is not None else None
        if kind == "mixed":
            self.num_after_graph += 1
        return kind

    def _launch_chained(self, batch: ScheduledBatch, tokens: torch.Tensor | None,
                        read_previous: Callable[[], None] | None,
                        after_host_grammar: bool) -> Literal["mixed", "graph"] | None:
        """Launch `batch`, scheduled with the rows of the step before fed back (`tokens`; that
        step read after the launch by `read_previous`, or None: read already): a mixed step if it
        prefills, else a decode graph where one can run it; which, or None (nothing launched)."""
        if batch.num_prefill_tokens:
            self.launch(batch, FedBack(tokens, self._fed_sources), read_previous, after_host_grammar)
            return "mixed"
        return "graph" if self._launch_graph(batch, tokens, read_previous, after_host_grammar) else None

    def _launch_graph(self, batch: ScheduledBatch, tokens: torch.Tensor | None,
                      read_previous: Callable[[], None] | None, after_host_grammar: bool) -> bool:
        """Decode rows alone after the step in flight: a decode graph fed its `tokens` on the
        device (the engine's step in flight), launched before that step is read and delivered;
        whether it could (rows the graph runs, tokens on a CUDA stream, and no grammar step
        after a host grammar step whose tokens are unpublished)."""
        engine = self.engine
        if (tokens is None or tokens.device.type != "cuda"
                or (engine.held is not None and engine.held.wants_host_step)
                or (after_host_grammar and (engine.table.pending_release
                                            or any(row.request.is_constrained for row in batch.rows)))
                or not engine.runner.can_graph(batch)):
            return False
        engine.launch_graph(batch, FedBack(tokens, self._fed_sources))
        if read_previous is not None:
            read_previous()
        with engine.lock:
            engine.deliver_deferred()
        self.num_into_graph += 1
        return True

    def collect(self, flight: MixedFlight) -> None:
        """Read a launched step's tokens and accept them; their delivery is deferred."""
        if flight.in_stream and flight.step is not None:
            masks, tokens = self.engine.link.wait_gpu(flight.step, len(flight.batch.sampling_rows))
            samples = [SampleResult([token]) for token in tokens]
        else:
            masks, samples = flight.masks, flight.sample.result()
        self.engine.finish_step(flight.batch, flight.step, samples, masks, flight.in_stream, flight.rows, defer=True)

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
