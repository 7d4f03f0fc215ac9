"""Engine: the in-process generation engine that the server, tests and benchmarks drive.

One background thread runs `step` in a loop:

    schedule  -> ScheduledBatch (continuous batching, chunked prefill, drafts, preemption)
    begin     -> descriptor + drafts into the step channel (grammar steps only)
    run       -> forward; logits of the sampling positions
    wait      -> grammar masks (watchdog)
    sample    -> masked sampling / draft verification
    postprocess -> stream events, finish requests, publish accepted tokens to the channel

Under runner "cuda_graph" a decode-only batch replaces run/wait/sample/publish by one graph
replay (`runner.launch`, then `runner.collect`): the GPU publishes inputs/outputs on the
channel itself, the link only wrote the descriptor and keeps the watchdog while the GPU
waits for masks.

Overlap (`EngineConfig.overlap`, on under "cuda_graph"): a launched decode step N stays in
flight across `step` calls. The next call launches N+1 for the same rows *before* it reads
N's tokens (the graph feeds its tokens back on the device), then postprocesses N while the
GPU runs N+1, so the host's bookkeeping hides behind the forward. N+1 is launched only when
nothing else can change the batch (no new, waiting, cancelled or releasing requests, no
row at its token limit or deadline, pages reserved); a row that N finishes (a stop token)
has computed one token too many in N+1, which is dropped (the request is finished). Any
other change ends the chain: N+1 is collected and the next step is scheduled as usual.
Mixed steps (prefill chunks beside decode rows) chain the same way under `pipeline_mixed`,
with prefill in every step: engine/mixed_steps.py.

Threads: `submit`, `cancel` and `stats` take `lock` briefly; the loop holds it for its
bookkeeping, never across the forward or the mask wait.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, replace

import torch

from generation_service.engine.config import EngineConfig, EngineStats
from generation_service.engine.errors import (
    EngineError, GrammarUnavailableError, InvalidRequestError, QueueFullError, ShuttingDownError,
)
from generation_service.engine.events import FinishReason
from generation_service.engine.grammar_link import GrammarControl, GrammarLink, LinkRow, StepMasks
from generation_service.engine.fed_back import FED_BACK_TOKEN, FedBack
from generation_service.engine.kv_cache import KVCache, PageAllocator, kv_cache_dtype, num_pages_for
from generation_service.engine.late_mask import HeldGraphs
from generation_service.engine.lifecycle import RequestTable
from generation_service.engine.mixed_steps import MixedSteps
from generation_service.engine.params import GenerationRequest
from generation_service.engine.prefix_cache import PrefixCache
from generation_service.engine.request import Request, RequestStatus
from generation_service.engine.runners import make_runner, resolve_runner
from generation_service.engine.sample_row import SampleRow, all_plain_greedy
from generation_service.engine.sampler import Sampler, SampleResult
from generation_service.engine.scheduler import ScheduledBatch, ScheduledRow, Scheduler, SlotPool, TokenBudget
from generation_service.engine.self_drafts import SelfDraftProposer
from generation_service.engine.speculative import PROPOSERS, DraftProposer, make_proposer
from generation_service.engine.step_time import StepTime
from generation_service.engine.stream import RequestStream
from generation_service.engine.validation import RequestLimits, validate_request
from generation_service.model.layer_skip import model_key
from step_channel import Geometry

log = logging.getLogger(__name__)
CPU_KV_BUDGET_BYTES = 256 << 20
CPU_PREFILL_CHUNK_TOKENS = 512   # the CPU's reference attention holds chunk x context fp32 scores
GPU_MAX_PREFILL_TOKENS = 8192    # a step no decode row shares: an idle server's long prompt in few steps
IDLE_WAIT_S = 0.02              # a step found no work: the loop waits this long for some (or a wake-up)
MIN_IDLE_WAIT_S = 0.0005        # ...or less, never so little that it spins
QUEUED_CHUNK_FACTOR = 3          # max_prefill_chunk_tokens unset: this many chunks while prompts queue

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestStream"]


@dataclass
class InFlight:
    """A launched decode step whose tokens have not been read (overlap)."""

    batch: ScheduledBatch
    step: int | None      # its grammar step, or None
    launch: object        # the runner's handle for `collect`


class Engine:
    def __init__(self, config: EngineConfig, grammar: GrammarControl | None = None) -> None:
        from generation_service.model.loader import load_model

        self.config = config
        if config.tensor_parallel > 1:  # this process is rank 0 of the started group
            from generation_service.parallel.group import current_group
            from generation_service.parallel.loading import load_shard
            loaded = load_shard(config.model, current_group(), config.dtype, config.seed)
        else:
            loaded = load_model(config.model, device=config.device, dtype=config.dtype, seed=config.seed,
                                quantization=config.quantization)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = config.model if loaded.path is None else loaded.path.rstrip("/").split("/")[-1]
        mc = loaded.config
        dtype = kv_cache_dtype(config.kv_cache_dtype, next(loaded.model.parameters()).dtype)  # embeddings first
        self.runner_name = resolve_runner(config.runner, config.device, config.tensor_parallel)
        num_pages = config.num_pages or self._num_pages_from_budget(mc, dtype, loaded.model)
        # the model's own KV heads: a tensor-parallel shard caches only its part
        kv_cache = KVCache(mc.num_layers, num_pages, config.page_size, loaded.model.config.num_kv_heads,
                           mc.head_dim, dtype, config.device)
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = PrefixCache(self.allocator, config.page_size, enabled=config.prefix_caching)
        self.slots = SlotPool(2 * config.max_batch)  # admitted requests + pending matcher releases
        self.proposers = {name: make_proposer(name) for name in PROPOSERS} | self._model_proposers(loaded)
        self.runner = make_runner(self.runner_name, loaded.model, kv_cache, mc.vocab_size,
                                  max_batch=config.max_batch,
                                  verify_width=1 + config.max_draft_tokens if config.verify_graphs else 0,
                                  max_context_tokens=config.max_prompt_tokens + config.max_new_tokens_limit
                                  + config.max_draft_tokens)
        self.token_budget, self.step_time = self._token_budget()
        self.config = config = replace(config, prefill_chunk_tokens=self.token_budget.with_decode,
                                       max_prefill_chunk_tokens=self.token_budget.max_with_decode,
                                       max_prefill_tokens=self.token_budget.alone)
        self.scheduler = Scheduler(
            self.prefix_cache, config.page_size, self.slots, max_batch=config.max_batch,
            max_waiting=config.max_waiting, budget=self.token_budget,
            propose_drafts=lambda r, k: self.proposers[r.spec.speculative.proposer].propose(r, k),
            token_bucket=self.runner.token_bucket, step_time=self.step_time,
            max_step_tokens=self.runner.max_step_tokens)
        self.sampler = Sampler(config.mask_backend)
        eos = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.eos_token_ids = tuple(sorted(eos))
        self.limits = RequestLimits(
            vocab_size=mc.vocab_size, max_positions=mc.max_position_embeddings,
            max_prompt_tokens=config.max_prompt_tokens, max_new_tokens_limit=config.max_new_tokens_limit,
            page_size=config.page_size, num_usable_pages=num_pages - 1, has_tokenizer=self.tokenizer is not None)
        self.link = self._make_link(grammar)
        self.table = RequestTable(self.scheduler, self.slots, self.tokenizer, self.eos_token_ids,
                                  late_rows_sit_out=self.runner.waits_for_every_mask)
        self.table.recompile = self._start_compile
        self.held = HeldGraphs(self.step_time.cost.decode_s) \
            if self.runner.waits_for_every_mask and self.step_time is not None else None
        self.lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[Request] = []
        self._cancels: list[tuple[str, EngineError | None]] = []
        self._thread: threading.Thread | None = None
        self._is_accepting = True
        self._is_stopped = False
        self.num_steps = 0
        self._overlap = config.overlap is not False and self.runner.supports_overlap
        if config.overlap and not self._overlap:
            log.warning("overlap needs the cuda_graph runner; runner %s steps one at a time", self.runner_name)
        self._in_flight: InFlight | None = None   # a launched decode step not yet read
        # Mixed steps stay in flight (mixed_steps.py): N+1 is launched before N is streamed
        # and, chained, before N's tokens are read; on by default where the forward is
        # asynchronous (CUDA graphs): there the host's work hides behind the GPU's.
        self._pipeline_mixed = (config.pipeline_mixed if config.pipeline_mixed is not None
                                else self.runner_name == "cuda_graph")
        self.mixed = MixedSteps(self, chain=self._pipeline_mixed and config.chain_mixed is not False)
        self.num_mixed_steps = 0
        self.num_prefill_tokens = 0
        self.step_s_total = {"graph": 0.0, "mixed": 0.0}  # engine-loop wall time per step kind

    def _token_budget(self) -> tuple[TokenBudget, StepTime | None]:
        """Prefill tokens per step (with decode rows / the most with them while prompts queue /
        without): the config's, else measured on the GPU (`MixedStepCost.chunk`), 3x that and
        8192 alone, else 512 on the CPU; and, where steps were measured, the cap on a step that
        decode rows share (`max_step_stretch` plain decode steps, step_time.py)."""
        config, on_gpu = self.config, self.runner_name == "cuda_graph"
        alone = config.max_prefill_tokens or max(
            GPU_MAX_PREFILL_TOKENS if on_gpu else CPU_PREFILL_CHUNK_TOKENS, config.prefill_chunk_tokens or 1)
        chunk = config.prefill_chunk_tokens
        # measured only where something needs it: the chunk, or the step-time cap
        cost = self.runner.measure_step_cost() if chunk is None or config.max_step_stretch else None
        if chunk is None:
            chunk = cost.chunk(alone) if cost is not None else CPU_PREFILL_CHUNK_TOKENS
        chunk = min(chunk, alone)
        queued = min(max(config.max_prefill_chunk_tokens or QUEUED_CHUNK_FACTOR * chunk, chunk), alone)
        budget = TokenBudget(chunk, alone, queued)
        step_time = StepTime(cost, config.max_step_stretch) if cost is not None and config.max_step_stretch else None
        log.info("prefill budget: %d tokens per step beside decode rows (up to %d while prompts queue%s), %d without "
                 "(%s)", budget.with_decode, budget.max_with_decode,
                 f", the step within {step_time.stretch:g} decode steps" if step_time else "", budget.alone,
                 "configured" if config.prefill_chunk_tokens else "measured" if on_gpu else "the CPU default")
        return budget, step_time

    def _model_proposers(self, loaded) -> dict[str, DraftProposer]:
        """The proposers that draft with the model (speculative.MODEL_PROPOSERS) through the
        runner's draft forward, reserving pages through the scheduler (both built after them:
        hence the lambdas)."""
        key = model_key(loaded.path, self.config.model, self.config.seed)
        return {"self": SelfDraftProposer(loaded.model, lambda *args: self.runner.draft_logits(*args),
                                          lambda request, num_tokens: self.scheduler.reserve(request, num_tokens),
                                          key, self.config.model, self.runner_name)}

    def _num_pages_from_budget(self, mc, dtype: torch.dtype, model) -> int:
        per_page = KVCache.bytes_per_page(mc.num_layers, self.config.page_size, model.config.num_kv_heads,
                                          mc.head_dim, dtype)
        budget = self.config.kv_memory_budget_bytes
        if budget is None and self.config.device.startswith("cuda"):
            budget = int(torch.cuda.mem_get_info()[0] * 0.85)
            if self.runner_name == "cuda_graph":  # its fused q/k/v and gate/up weight copies
                budget -= sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
        budget = budget or CPU_KV_BUDGET_BYTES
        # No more than every slot of the batch at its longest context can use.
        cap = self.config.max_batch * num_pages_for(
            self.config.max_prompt_tokens + self.config.max_new_tokens_limit + self.config.max_draft_tokens,
            self.config.page_size)
        return max(2, min(budget // per_page, cap) + 1)

    def _make_link(self, grammar: GrammarControl | None) -> GrammarLink | None:
        if grammar is None or self.tokenizer is None:
            return None
        geometry = Geometry(max_batch=2 * self.config.max_batch,  # sampling rows + release rows
                            max_positions=1 + self.config.max_draft_tokens,
                            vocab_size=self.model_config.vocab_size, depth=self.config.channel_depth)
        return GrammarLink(grammar, geometry, max_slots=self.slots.num_slots,
                           tokenizer_dir=self.tokenizer.path,
                           tokenizer_fingerprint=self.tokenizer.fingerprint(),
                           wait_timeout_s=self.config.grammar_wait_timeout_s)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Open the step channel with grammar_service (retried later if it is down) and start
        the loop thread."""
        if self.link is not None and not self.link.connect():
            log.warning("grammar_service not reachable at start; constrained requests fail until it is")
        elif self.link is not None:
            self.runner.attach(self.link)  # the channel's graphs now, not in the first constrained step
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, grace_s: float = 0) -> None:
        """Refuse new requests, let running ones finish for `grace_s`, cancel the rest, close."""
        self._is_accepting = False
        deadline = time.monotonic() + grace_s
        while self.table.num_live and time.monotonic() < deadline:
            time.sleep(0.02)
        with self.lock:
            error = ShuttingDownError("the engine shut down before the request finished")
            self._cancels.extend((request_id, error) for request_id in self.table.ids())
        self._wake.set()
        if self._thread is not None:
            self._wait_released(timeout_s=2.0)
            self._is_stopped = True
            self._wake.set()
            self._thread.join(timeout=30)
        self.runner.close()  # NOTE: graphs and registration go before the region
        if self.link is not None:
            self.link.close()

    def _wait_released(self, timeout_s: float) -> None:
        """Let the loop apply the cancels and send their RELEASE rows before it stops."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if not (self._cancels or self.table.num_live or self.table.num_bound_matchers):
                    return
            self._wake.set()
            time.sleep(0.02)

    # ---- requests ------------------------------------------------------------------------
    def submit(self, spec: GenerationRequest, stream: RequestStream | None = None) -> RequestStream:
        """Queue a request; raises InvalidRequestError, LimitExceededError, QueueFullError or
        ShuttingDownError. Constrained requests start compiling at once. `stream`: where its
        events go (default a new RequestStream; the engine process passes one that forwards)."""
        if not self._is_accepting:
            raise ShuttingDownError("the engine is shutting down")
        validate_request(spec, self.limits)
        if spec.speculative.num_draft_tokens:
            self.proposers[spec.speculative.proposer].check_ready()
        seed = spec.sampling.seed if spec.sampling.seed is not None else secrets.randbits(63)
        stop_ids = frozenset(spec.sampling.stop_token_ids)
        request = Request(spec, stop_ids, seed, eos_token_ids=frozenset(self.eos_token_ids))
        stream = stream or RequestStream(spec.request_id, self.cancel)
        with self.lock:
            self._check_admissible(spec)
        if request.is_constrained:
            self._start_compile(request)  # before it is queued: the loop sees a future or an error
        with self.lock:
            self._check_admissible(spec)
            self.table.attach_stream(request, stream)
            self._inbox.append(request)
        self._wake.set()
        return stream

    def _check_admissible(self, spec: GenerationRequest) -> None:
        if self.table.has(spec.request_id) or any(r.request_id == spec.request_id for r in self._inbox):
            raise InvalidRequestError(f"request_id {spec.request_id!r} is already in use")
        if self.scheduler.num_waiting_new + len(self._inbox) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")

    def _start_compile(self, request: Request) -> None:
        if self.link is None:
            request.error = GrammarUnavailableError("constrained decoding is unavailable: no grammar_service")
            return
        try:
            # with its budget: grammar_service closes the output within it (or refuses it up front)
            grammar = replace(request.spec.grammar, max_tokens=request.max_new_tokens)
            future = self.link.control.compile(grammar, trace_context=request.spec.trace_context)
        except Exception as error:  # noqa: BLE001
            request.error = GrammarUnavailableError(f"grammar compile failed to start: {error}")
            return
        request.compile_future = future
        future.add_done_callback(lambda _: self._wake.set())

    def cancel(self, request_id: str) -> None:
        """Finish the request as CANCELLED (no-op if it has finished)."""
        with self.lock:
            self._cancels.append((request_id, None))
        self._wake.set()

    def stats(self) -> EngineStats:
        with self.lock:
            return EngineStats(
                num_waiting=len(self.scheduler.waiting) + len(self._inbox),
                num_running=len(self.scheduler.running),
                num_preempted=len(self.scheduler.waiting) - self.scheduler.num_waiting_new,
                num_kv_pages_used=self.prefix_cache.num_used_pages,
                num_kv_pages_total=self.allocator.num_pages - 1,
                num_slots_used=self.slots.num_used,
                num_grammar_matchers=self.table.num_bound_matchers,
                grammar_available=self.link is not None and self.link.is_connected,
                draft_proposed=self.table.draft_proposed, draft_accepted=self.table.draft_accepted,
                steps=self.num_steps, grammar_steps=self.link.num_steps if self.link else 0,
                grammar_wait_s_total=self.link.wait_s_total if self.link else 0.0,
                grammar_wait_counts=tuple(self.link.wait_counts) if self.link else (),
                grammar_disconnects=self.link.num_disconnects if self.link else 0,
                num_preemptions=self.scheduler.num_preemptions,
                num_finished=self.table.num_finished, tokens_generated=self.table.tokens_generated,
                num_mixed_steps=self.num_mixed_steps, num_prefill_tokens=self.num_prefill_tokens,
                graph_step_s_total=self.step_s_total["graph"], mixed_step_s_total=self.step_s_total["mixed"],
                num_kv_pages_cached=self.prefix_cache.num_cached_pages,
                prefix_cache_query_tokens=self.prefix_cache.num_query_tokens,
                prefix_cache_hit_tokens=self.prefix_cache.num_hit_tokens,
                prefix_cache_evictions=self.prefix_cache.num_evictions,
                num_late_rows=self.table.num_late_rows,
                num_forced_tokens=self.table.num_forced_tokens,
                num_grammar_rejected_drafts=self.table.num_grammar_rejected_drafts,
                num_held_graph_host_steps=self.held.num_probes if self.held is not None else 0,
                num_chained_steps=(getattr(self.runner, "num_chained_steps", 0) + self.mixed.num_chained
                                   + self.mixed.num_into_graph),
                num_chained_grammar_steps=self.mixed.num_chained_grammar)

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._is_stopped:
            try:
                did_work = self.step()
            except Exception as error:  # noqa: BLE001 -- a bug must not hang every stream
                log.exception("engine step failed")
                self._in_flight = self.mixed.in_flight = None
                with self.lock:
                    if self.link is not None:
                        self.link.abandon_open_step()  # never leave a step half-published
                    self.table.fail_all(EngineError(f"engine step failed: {error!r}"), self.link)
                did_work = False
            if not did_work:
                self._wake.wait(self._idle_wait_s())
                self._wake.clear()
        if self._in_flight is not None:  # stopped with a step on the GPU: read it (watchdog)
            in_flight, self._in_flight = self._in_flight, None
            self.finish_step(in_flight.batch, in_flight.step, *self.runner.collect(in_flight.launch, self.link), True)
        if self.mixed.in_flight is not None:
            in_flight, self.mixed.in_flight = self.mixed.in_flight, None
            self.mixed.collect(in_flight)
        with self.lock:
            self.deliver_deferred()

    def step(self) -> bool:
        """One engine step; False when there was nothing to do."""
        start = time.perf_counter()
        if self._in_flight is not None:
            previous, into_mixed = self._step_chained()
            if into_mixed:  # a mixed step launched: this step's time is the mixed step's
                self._mixed_step_done(time.perf_counter() - start)
            else:
                self._decode_step_done(time.perf_counter() - start, previous.batch, previous.step)
            return True
        if self.mixed.in_flight is not None:  # chain the next mixed step, or read this one
            self.mixed.step()
            self._mixed_step_done(time.perf_counter() - start)
            return True
        with self.lock:
            self.apply_inbox()
            self.table.poll(self.link)  # compiles, deadlines, grammar reconnect
            if self.link is not None:
                self.scheduler.mask_lead_s = self.link.forward_s
            batch = self.scheduler.schedule(self.config.max_draft_tokens)
            graphed = self.runner.can_graph(batch) and not (self.held is not None and self.held.wants_host_step)
            pipelined = self._pipeline_mixed and bool(batch.rows) and not graphed
            if self.held is not None and batch.rows and not graphed and not pipelined:
                self.held.host_step()  # (a pipelined one tells it when it is a host grammar step)
            delivered = bool(self.table.deferred)
            if not pipelined:
                if self.deliver_deferred():  # a stop string found now ends its row of `batch`
                    batch = ScheduledBatch([row for row in batch.rows if not row.request.is_finished])
                    graphed = graphed and self.runner.can_graph(batch)
                rows = self.table.grammar_rows(batch, self.link)
                if batch.is_empty and not rows:
                    return delivered
                step = self.link.begin(rows, gpu=graphed) if rows else None
        if pipelined:
            self.mixed.launch(batch)
            self._mixed_step_done(time.perf_counter() - start)
            return True
        if graphed:  # the GPU writes the outputs and outputs_seq of a grammar step
            launch = self.runner.launch(batch, step, self.link)
            if self._overlap:
                self._in_flight = InFlight(batch, step, launch)
                self.step_s_total["graph"] += time.perf_counter() - start
                return True
            samples, masks = self.runner.collect(launch, self.link)
        else:
            forward_started = time.perf_counter()
            logits = self.runner.run(batch) if batch.rows else None
            if self.link is not None and batch.rows:
                self.link.forward_done(step, time.perf_counter() - forward_started)
            masks = self.link.wait(step) if step is not None else None
            samples = self._sample(batch, logits, masks)
            self.num_mixed_steps += bool(batch.rows)
            self.num_prefill_tokens += batch.num_prefill_tokens
        self.finish_step(batch, step, samples, masks, graphed, rows)
        if graphed:
            self._decode_step_done(time.perf_counter() - start, batch, step)
        else:
            self.step_s_total["mixed"] += time.perf_counter() - start
        return True

    def _decode_step_done(self, seconds: float, batch: ScheduledBatch, step: int | None) -> None:
        """A decode graph step of `batch` (grammar step `step`) took `seconds` of the loop
        (overlapped: from the previous one)."""
        self.step_s_total["graph"] += seconds
        if self.step_time is not None:
            self.step_time.observe_decode(seconds, len(batch.rows))
        if self.held is not None:
            self.held.graph_step(seconds, step is not None)

    def _mixed_step_done(self, seconds: float) -> None:
        """A mixed step launched (and the one before it read) in `seconds` of the loop. One in
        stream order waits for its masks on the device as a graph step does: one held that long
        asks for a host step too (late_mask.HeldGraphs)."""
        self.step_s_total["mixed"] += seconds
        flight = self.mixed.in_flight
        if self.held is not None and flight is not None and flight.in_stream and flight.step is not None:
            cost = self.step_time.cost  # (held graphs exist where steps were measured)
            tokens = self.runner.token_bucket(flight.batch.num_tokens)
            self.held.graph_step(seconds, True, cost.fixed_s + cost.per_token_s * tokens)

    def deliver_deferred(self) -> bool:
        """Stream the tokens the last mixed step deferred (engine lock held); whether a request
        ended by it (a stop string)."""
        return bool(self.table.deferred) and self.table.deliver()

    def finish_step(self, batch: ScheduledBatch, step: int | None, samples: list[SampleResult],
                masks: StepMasks | None, graphed: bool, rows: list[LinkRow] = (), defer: bool = False) -> None:
        """Postprocess a step; a host-side grammar step then publishes its accepted tokens.
        defer: the step's text and stream events wait in the table's `deferred` (mixed_steps.py)."""
        with self.lock:
            kept = self.table.postprocess(batch, samples, step, masks, self.link, defer)
            if step is not None and not graphed:
                self.link.publish(step, [kept.get(id(row.request), []) for row in rows])
            self.num_steps += 1

    def _step_chained(self) -> tuple[InFlight, bool]:
        """Overlap: launch N+1 for the rows of the in-flight step N if nothing changes the
        batch, else the next step scheduled with N's rows fed back, a mixed step or a decode
        graph loaded anew (`MixedSteps.launch_after_graph`), then read and postprocess N (while
        the GPU runs N+1); N, and whether N+1 is a mixed step."""
        previous, self._in_flight = self._in_flight, None
        with self.lock:
            batch = self._chained_batch(previous)
            step = None
            if batch is not None and previous.step is not None:
                step = self.link.begin([LinkRow.sampling(row.request, []) for row in batch.rows], gpu=True)
        if batch is not None:
            self._in_flight = InFlight(batch, step, self.runner.launch(batch, step, self.link, chained=True))
        else:  # the batch changes (a row ends or joins, new work): the next step is scheduled
            tokens = self.runner.step_tokens(previous.launch)
            kind = tokens is not None and self.mixed.launch_after_graph(
                previous.batch.rows, tokens, lambda: self._read_graph_step(previous, defer=True))
            if kind:
                return previous, kind == "mixed"
        self._read_graph_step(previous)
        return previous, False

    def launch_graph(self, batch: ScheduledBatch, fed_back: FedBack) -> None:
        """Launch a decode graph step of `batch` whose fed-back rows take their tokens from the
        step in flight on the device (mixed_steps.py); it is in flight once this returns."""
        with self.lock:
            rows = self.table.grammar_rows(batch, self.link)
            step = self.link.begin(rows, gpu=True) if rows else None
        self._in_flight = InFlight(batch, step, self.runner.launch(batch, step, self.link, fed_back=fed_back))

    def _read_graph_step(self, launched: InFlight, defer: bool = False) -> None:
        samples, masks = self.runner.collect(launched.launch, self.link)
        self.finish_step(launched.batch, launched.step, samples, masks, True, defer=defer)

    def _chained_batch(self, previous: InFlight) -> ScheduledBatch | None:
        """The step after `previous` for the same rows, one token further, or None when
        anything may change the batch (then `previous` is read and the scheduler runs)."""
        if self._inbox or self._cancels or self.scheduler.waiting or self.table.pending_release:
            return None
        if self.held is not None and self.held.wants_host_step:
            return None  # a fill held a graph step: the scheduler makes the next a host step (late_mask.py)
        if self.link is not None and not self.link.is_connected:
            return None  # let `poll` reconnect and fail what needs the grammar
        if previous.step is not None and self.runner.channel is not self.link.channel:
            return None
        requests = [row.request for row in previous.batch.rows]
        if len(self.scheduler.running) != len(requests) and self._may_join(requests, self.scheduler.masks_read_at()):
            return None  # a running request outside the batch (compiling, a late row now due) may join
        now = time.monotonic()
        for row in previous.batch.rows:
            request = row.request
            if (request.status is not RequestStatus.RUNNING
                    or request.num_generated + 2 > request.max_new_tokens  # N's token may be its last
                    or (request.spec.deadline is not None and now > request.spec.deadline)
                    or (self.config.max_draft_tokens and request.spec.speculative.num_draft_tokens)):
                return None
        rows = []
        max_pages = self.runner.max_pages_per_row
        for row in previous.batch.rows:
            # (pages reserved before a refusal are kept for the next scheduled step)
            if not self.scheduler.reserve(row.request, row.seq_len + 1) or len(row.request.pages) > max_pages:
                return None
            rows.append(ScheduledRow(row.request, row.seq_len, [FED_BACK_TOKEN], is_sampling=True))
        # NOTE: the rest of can_graph (one sampling token per row, no drafts or logprobs,
        # the batch fits a bucket) held for `previous` and nothing of it changed.
        return ScheduledBatch(rows)

    def _idle_wait_s(self) -> float:
        """How long the loop waits for work: IDLE_WAIT_S, or until the first late row that sits
        out is due (its step reads masks a forward after it starts; late_mask.py)."""
        due = min((r.late_mask.due_s for r in self.scheduler.running if r.late_mask is not None), default=None)
        if due is None:
            return IDLE_WAIT_S
        return min(IDLE_WAIT_S, max(due - self.scheduler.masks_read_at(), MIN_IDLE_WAIT_S))

    def _may_join(self, requests: list[Request], now: float) -> bool:
        """Whether a running request outside `requests` may join a step whose masks are read at
        `now`: any but a late row that sits out (late_mask.py), which leaves a chain of decode
        graphs alone."""
        inside = {id(request) for request in requests}
        return any(id(request) not in inside and not request.sits_out(now) for request in self.scheduler.running)

    def _sample(self, batch: ScheduledBatch, logits, masks: StepMasks | None) -> list[SampleResult]:
        rows = batch.sampling_rows
        if not rows:
            return []
        if all_plain_greedy(rows):
            return self.sampler.launch_greedy(logits).result()
        sample_rows = [SampleRow.of(row, row.request.is_constrained and masks is not None) for row in rows]
        return self.sampler(logits, sample_rows, masks.bitmask if masks is not None else None)

    def apply_inbox(self) -> None:
        for request in self._inbox:
            if request.is_finished:  # failed while queued (fail_all)
                continue
            try:
                if request.error is not None:
                    raise request.error
                self.scheduler.add(request)
            except EngineError as error:
                self.table.finish(request, FinishReason.ERROR, error)
        self._inbox.clear()
        for request_id, error in self._cancels:
            self.table.cancel(request_id, error)
        self._cancels.clear()
