"""RequestTable: the live requests, their streams, and every way a request moves on or ends.

It owns what happens around a step: compile results and deadlines (`poll`), the descriptor
rows of a grammar step (`grammar_rows`), turning samples into stream events and finishing
requests (`postprocess`, `finish`), and releasing slots and matchers. Called by the engine
loop with the engine lock held.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from generation_service.engine.errors import (
    DeadlineExceededError, EngineError, GrammarError, GrammarUnavailableError,
)
from generation_service.engine.events import FinishReason, OutputEvent, Usage
from generation_service.engine.grammar_link import GrammarLink, LinkRow, RowResult, StepMasks
from generation_service.engine.late_mask import LateMask
from generation_service.engine.output import OutputProcessor
from generation_service.engine.request import ForcedRun, Request, RequestStatus
from generation_service.engine.sampler import SampleResult
from generation_service.engine.scheduler import ScheduledBatch, Scheduler, SlotPool
from generation_service.engine.stream import RequestStream
from grammar_contract.report import GuaranteeReport
from step_channel import ERR_NO_MATCHER, ERR_TOKEN_REJECTED, ERR_UNKNOWN_GRAMMAR, VALID_LATE

log = logging.getLogger(__name__)
_FINISHED = RequestStatus.FINISHED


@dataclass
class Deferred:
    """A token accepted by a pipelined step whose text and stream event are still to come."""

    request: Request
    output: OutputProcessor  # the request's, looked up once by `_accept`: `deliver` runs per row
    token: int
    logprobs: list


class RequestTable:
    def __init__(self, scheduler: Scheduler, slots: SlotPool, tokenizer, eos_token_ids: tuple[int, ...],
                 late_rows_sit_out: bool = False) -> None:
        self.scheduler = scheduler
        self.late_rows_sit_out = late_rows_sit_out  # the runner's ModelRunner.waits_for_every_mask
        self.slots = slots
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._requests: dict[str, Request] = {}
        self._streams: dict[str, RequestStream] = {}
        self._outputs: dict[str, OutputProcessor] = {}
        self.pending_release: list[int] = []   # slots whose matcher needs a RELEASE row
        self._releasing: list[int] = []        # slots released by the step in flight
        self.draft_proposed = 0
        self.draft_accepted = 0
        self.num_forced_tokens = 0             # forced-run drafts accepted
        self.num_grammar_rejected_drafts = 0   # drafts the grammar refused (and those after them)
        self.num_finished = 0
        self.num_late_rows = 0                 # sampling rows skipped: their masks were late
        self.num_fast_again = 0                # late rows back in decode graphs (late_mask.py)
        self.tokens_generated = 0
        # request_id -> its token accepted by a pipelined step, not yet streamed (`deliver`)
        self.deferred: dict[str, Deferred] = {}
        # Called with each finished Request (engine thread, lock held): traces, metrics.
        self.finish_listeners: list[Callable[[Request], None]] = []
        # Starts a request's compile again (Engine._start_compile); sets request.error when it cannot
        self.recompile: Callable[[Request], None] = lambda request: None

    # ---- membership ------------------------------------------------------------------------
    def attach_stream(self, request: Request, stream: RequestStream) -> None:
        self._requests[request.request_id] = request
        self._streams[request.request_id] = stream
        self._outputs[request.request_id] = OutputProcessor(request, self.tokenizer, self.eos_token_ids)

    def has(self, request_id: str) -> bool:
        return request_id in self._requests

    def ids(self) -> list[str]:
        return list(self._requests)

    @property
    def num_live(self) -> int:
        return len(self._requests)

    @property
    def num_bound_matchers(self) -> int:
        bound = sum(1 for r in self._requests.values() if r.is_matcher_bound)
        return bound + len(self.pending_release) + len(self._releasing)

    # ---- before a step -------------------------------------------------------------------
    def poll(self, link: GrammarLink | None) -> None:
        """Finished compiles, expired deadlines, and grammar_service coming back."""
        if link is not None and not link.is_connected:
            link.maybe_reconnect()
        now = time.monotonic()
        # a grammar compiled while the channel is down waits for it (a standby grammar_service
        # takes over in a second), up to the watchdog's deadline; then its request fails below
        holds = link is not None and not link.is_connected and now - link.disconnected_at < link.wait_timeout_s
        for request in list(self._requests.values()):
            future = request.compile_future
            if future is not None and request.grammar_id is None and future.done() and \
                    not (holds and future.exception() is None):
                self._on_compiled(request)
            if not request.is_finished and request.spec.deadline is not None and now > request.spec.deadline:
                self.finish(request, FinishReason.DEADLINE, DeadlineExceededError(
                    f"request {request.request_id}: deadline exceeded"))
        if link is not None and not link.is_connected:
            for request in list(self._requests.values()):
                if request.is_constrained and request.can_sample:  # compiled, but no channel
                    self.finish(request, FinishReason.ERROR, GrammarUnavailableError(
                        "grammar_service is unavailable (step channel not connected)"))

    def _on_compiled(self, request: Request) -> None:
        try:
            result = request.compile_future.result()
        except EngineError as error:
            self.finish(request, FinishReason.ERROR, error)
            return
        except Exception as error:  # noqa: BLE001
            self.finish(request, FinishReason.ERROR, GrammarUnavailableError(f"grammar compile failed: {error!r}"))
            return
        request.grammar_id = result.grammar_id
        if request.guarantee is not None:  # compiled again after grammar_service was lost: reported once
            return
        request.guarantee = GuaranteeReport(result.backend, tuple(result.unenforced), result.compile_ms,
                                            result.cache_hit, tuple(result.restricted), result.fallback_from)
        self._streams[request.request_id].put(OutputEvent(guarantee=request.guarantee))

    def grammar_rows(self, batch: ScheduledBatch, link: GrammarLink | None) -> list[LinkRow]:
        """Descriptor rows when the step needs the channel (constrained or release rows), else []."""
        if link is None or not link.is_connected:
            return []
        sampling = batch.sampling_rows
        if not self.pending_release and not any(row.request.is_constrained for row in sampling):
            return []
        rows = [LinkRow.sampling(row.request, row.drafts) for row in sampling]
        rows += [LinkRow.release(slot) for slot in self.pending_release]
        for row in sampling:
            row.request.is_matcher_bound |= row.request.is_constrained  # FRESH goes out now
        # NOTE: added to, not replaced: a step in stream order is described before the step in
        # flight is read, whose postprocess then frees both steps' slots (freeing early is safe:
        # grammar_service applies a release before any later step's bind)
        self._releasing += self.pending_release
        self.pending_release = []
        return rows

    # ---- after a step ------------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, samples: list[SampleResult], step: int | None,
                    masks: StepMasks | None, link: GrammarLink | None, defer: bool = False) -> dict[int, list[int]]:
        """Apply a step's results; returns accepted tokens per request (by id()) for the channel.
        defer (a pipelined mixed step, engine.py): a one-token row that no token stop ends is
        only accepted here (the scheduler's state); its text, stop strings and stream event wait
        in `deferred` for `deliver`, which runs while the GPU computes the next step."""
        if step is not None:
            if masks is None:
                self._on_grammar_lost()
            else:
                self._apply_results(masks.results)
        for slot in self._releasing:  # grammar_service dropped them in this step (or is gone)
            self.slots.free(slot)
        self._releasing = []
        kept: dict[int, list[int]] = {}
        pushed: list[RequestStream] = []  # woken once every row is done (stream.py says why)
        sampling = iter(zip(batch.sampling_rows, samples))
        page_size = self.scheduler.cache.page_size
        for row in batch.rows:
            request = row.request
            if not row.is_sampling:
                if not request.is_finished:
                    # max: a chained step launched after this one has advanced it already
                    request.num_cached = max(request.num_cached, row.seq_len)
                    self.scheduler.store_pages(request)
                continue
            _, result = next(sampling)
            # (`status is FINISHED`, not the property: this loop runs per row per step)
            if request.status is _FINISHED:
                continue
            if masks is not None:
                valid = masks.valid_positions[id(request)] if request.is_constrained else 1
                if valid == 0:
                    self.finish(request, FinishReason.ERROR, GrammarUnavailableError(
                        "grammar_service has no matcher for this request"))
                    continue
                if valid == VALID_LATE:  # its mask was not ready: sampled again next step
                    self._skip(row, request)
                    continue
                if row.drafts and request.is_constrained:  # the walk stopped at the first refused draft
                    refused = len(row.drafts) + 1 - valid
                    request.num_grammar_rejected_drafts += refused
                    self.num_grammar_rejected_drafts += refused
                if request.wants_forced_drafts:
                    # the run starts at the token this step sampled at position valid - 1
                    request.forced_run = ForcedRun(request.num_tokens + valid - 1,
                                                   tuple(masks.forced.get(id(request), ())))
            if request.late_mask is not None and not request.late_mask.sampled(time.monotonic(),
                                                                               self.scheduler.mask_lead_s):
                request.late_mask = None  # fast again: back in decode graphs (late_mask.py)
                self.num_fast_again += 1
            kept[id(request)] = self._accept(row, request, result, pushed, defer)
            # Only a row that filled a page has one to key (`PrefixCache.store`): most fill none.
            # (a finished one's pages were keyed as they were freed)
            if request.num_cached // page_size > request.num_stored_pages and request.status is not _FINISHED:
                self.scheduler.store_pages(request)
        for stream in pushed:
            stream.wake()
        return kept

    def _accept(self, row, request: Request, result: SampleResult, pushed: list[RequestStream],
                defer: bool) -> list[int]:
        if row.drafts:
            self._accept_drafts(row, request, result)
        else:  # K/V is valid for the known tokens (and more, when a chained step is in flight)
            request.num_cached = max(request.num_cached, row.seq_len)
        if request.first_token_s is None and result.token_ids:
            request.first_token_s = time.monotonic()
        request_id = request.request_id
        output = self._outputs[request_id]
        if defer and len(result.token_ids) == 1:
            token = result.token_ids[0]
            reason = output.accept(token)
            if reason is None:
                self.deferred[request_id] = Deferred(request, output, token, result.logprobs)
                return [token]
            delta = output.render(token, result.logprobs, reason)
        else:
            delta = output.process(result.token_ids, result.logprobs)
        self._emit(request, delta, pushed)
        return delta.token_ids

    def _emit(self, request: Request, delta, pushed: list[RequestStream]) -> None:
        if delta.finish_reason is not None:
            self.finish(request, delta.finish_reason, None, delta.token_ids, delta.text, delta.logprobs)
        elif delta.token_ids:
            stream = self._streams[request.request_id]
            stream.push(OutputEvent.of_tokens(tuple(delta.token_ids), delta.text, tuple(delta.logprobs)))
            pushed.append(stream)

    def deliver(self) -> bool:
        """The text, stop strings and stream events of the tokens `postprocess` deferred;
        whether a stop string ended a request."""
        pushed: list[RequestStream] = []
        deferred, self.deferred = self.deferred, {}
        num_finished = self.num_finished
        for item in deferred.values():
            self._emit(item.request, item.output.render(item.token, item.logprobs), pushed)
        for stream in pushed:
            stream.wake()
        return self.num_finished != num_finished

    def _skip(self, row, request: Request) -> None:
        """A late row accepts nothing: K/V stays valid up to its last known token, which the next
        step computes again and samples after (the same draw: seeded by token index)."""
        request.num_cached = row.seq_len - len(row.drafts) - 1
        if self.late_rows_sit_out:
            if request.late_mask is None:
                request.late_mask = LateMask()
            request.late_mask.late(time.monotonic())
        self.num_late_rows += 1
        if row.drafts:
            self.scheduler.trim_pages(request)
        self.scheduler.store_pages(request)

    def _accept_drafts(self, row, request: Request, result: SampleResult) -> None:
        # K/V is valid for the known tokens and the accepted drafts; the rest is rolled back.
        request.num_cached = row.seq_len - len(row.drafts) + result.num_accepted_drafts
        request.num_drafts_proposed += len(row.drafts)
        request.num_drafts_accepted += result.num_accepted_drafts
        self.draft_proposed += len(row.drafts)
        self.draft_accepted += result.num_accepted_drafts
        forced = min(result.num_accepted_drafts, request.num_forced_drafts)
        request.num_forced_tokens += forced
        self.num_forced_tokens += forced
        # NOTE: only rejected drafts leave pages past the cache; without drafts a page
        # may be reserved already for the next step launched before this one was read.
        self.scheduler.trim_pages(request)

    def _apply_results(self, results: list[RowResult]) -> None:
        for result in results:
            request = result.request
            request.is_budget_closed |= result.budget_closed
            if request.is_finished or not result.error:
                continue
            if result.error == ERR_TOKEN_REJECTED:
                # the token was sampled under this grammar's own mask: the grammar drove its
                # backend past a limit (llguidance: "parser too complex") or into a dead end
                log.warning("grammar of request %s refused a token its mask allowed", request.request_id)
                error = GrammarError(f"request {request.request_id}: the grammar's matcher refused a token its "
                                     "own mask allowed (the grammar is too complex for its backend here, or "
                                     "can never finish); simplify it or try the other grammar backend")
            elif result.error in (ERR_UNKNOWN_GRAMMAR, ERR_NO_MATCHER):
                error = GrammarUnavailableError("grammar_service lost this request's grammar")
            else:
                error = EngineError(f"grammar_service error {result.error} for request {request.request_id}")
            self.finish(request, FinishReason.ERROR, error)

    def _on_grammar_lost(self) -> None:
        """The watchdog released a step: the requests whose matchers grammar_service held fail,
        free ones go on, and those with no matcher yet compile again (a grammar id names a
        grammar of the process that compiled it; the compile waits for the one after it)."""
        error = GrammarUnavailableError("grammar_service is unavailable (it stopped answering)")
        for request in list(self._requests.values()):
            if not request.is_constrained:
                continue
            if request.is_matcher_bound:
                self.finish(request, FinishReason.ERROR, error)
            elif request.compile_future is not None and request.compile_future.done():
                request.grammar_id = None
                self.recompile(request)
                if request.error is not None:
                    self.finish(request, FinishReason.ERROR, request.error)
        for slot in self.pending_release:  # its matchers are gone with it
            self.slots.free(slot)
        self.pending_release = []

    # ---- the end -----------------------------------------------------------------------------
    def cancel(self, request_id: str, error: EngineError | None = None) -> None:
        request = self._requests.get(request_id)
        if request is not None and not request.is_finished:
            self.finish(request, FinishReason.CANCELLED, error)

    def fail_all(self, error: EngineError, link: GrammarLink | None) -> None:
        for request in list(self._requests.values()):
            self.finish(request, FinishReason.ERROR, error)

    def finish(self, request: Request, reason: FinishReason, error: EngineError | None,
               token_ids: list[int] = (), text: str = "", logprobs=()) -> None:
        """End a request: free pages and slot (its matcher via a RELEASE row), final event."""
        if request.is_finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.error = reason, error
        self.scheduler.remove(request)
        if request.slot is not None:
            if request.is_matcher_bound:
                self.pending_release.append(request.slot)  # freed once the RELEASE row is applied
            else:
                self.slots.free(request.slot)
            request.slot = None
        request.is_matcher_bound = False  # (a pending compile just finishes into the cache)
        output = self._outputs.pop(request.request_id)
        pending = self.deferred.pop(request.request_id, None)
        if pending is not None:  # ended (cancel, deadline, error) before its last token was streamed
            token_ids, logprobs = [pending.token, *token_ids], [*pending.logprobs[:1], *logprobs]
            text = output.render(pending.token, pending.logprobs).text + text
        if reason in (FinishReason.CANCELLED, FinishReason.DEADLINE):
            text += output.flush()  # held-back text that never became a stop string
        usage = Usage(request.num_prompt_tokens, request.num_generated,
                      request.num_drafts_proposed, request.num_drafts_accepted, request.num_cached_prompt_tokens,
                      request.num_forced_tokens, request.num_grammar_rejected_drafts)
        stream = self._streams.pop(request.request_id)
        del self._requests[request.request_id]
        self.num_finished += 1
        self.tokens_generated += request.num_generated
        # NOTE: listeners before the final event: a client holding its final message finds the
        # request's histograms recorded and its spans annotated (the rpc span is still open).
        for listener in self.finish_listeners:
            try:
                listener(request)
            except Exception:  # noqa: BLE001 -- observers must never fail the engine
                log.exception("finish listener %r failed for request %s", listener, request.request_id)
        stream.put(OutputEvent(tuple(token_ids), text, tuple(logprobs), finish_reason=reason,
                               usage=usage, error=error))
