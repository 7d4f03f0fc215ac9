"""Scheduler: continuous batching with chunked prefill, paged KV and preemption by recompute.

Each step it builds one mixed batch: running requests first (oldest first: a decode row of
1 + drafts tokens, or the next prefill chunk), then admits waiting requests while rows,
slots, the step's prefill token budget and pages allow. The budget (`TokenBudget`) is small
while decode rows share the step (each of them waits for the whole step, so a long prompt
delays them by at most one budget's worth of prefill) and large when none does (an idle
server prefills a long prompt in few steps). Beside decode rows it grows with the prompt
tokens that wait, up to a limit: at high concurrency prompts arrive faster than the small
budget prefills them, and rows that could decode would sit in the queue instead (the output
of a step is at most its prefill over the prompt/output ratio of the load); a step that decode
rows share still stays within a few of their recent decode steps' time (`StepTime`, measured on
a GPU), so the queue's growth never makes their steps uneven. Decode rows never count against
it. When a running request needs a page and none is free or cached, the newest running
request is preempted: its pages are freed and it goes back to the head of the queue, keeping
its slot (and so its grammar matcher); it later re-prefills prompt + output and continues with
the same tokens. Admission is FIFO and stops at
the first request that does not fit, so preempted requests resume before new ones start (a
compiling request with nothing left to prefill is stepped over).

Pages come from the PrefixCache (engine/prefix_cache.py): an admitted request first takes the
cached pages of its longest cached prefix (a preempted one may find its own still there) and
prefills from there; freed full pages stay cached until `reserve` needs their room.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

from generation_service.engine.errors import QueueFullError
from generation_service.engine.kv_cache import num_pages_for
from generation_service.engine.prefix_cache import PrefixCache
from generation_service.engine.request import Request, RequestStatus
from generation_service.engine.step_time import StepTime


@dataclass
class ScheduledRow:
    """One request's part of a forward."""

    request: Request
    num_cached: int            # tokens already cached before this forward
    input_ids: list[int]       # uncached tokens of the request, then `drafts`
    drafts: list[int] = field(default_factory=list)
    is_sampling: bool = False  # the chunk reaches the request's last token: sample after it

    @property
    def num_positions(self) -> int:
        """Logit rows this row needs: 1 + drafts when sampling, else 0."""
        return 1 + len(self.drafts) if self.is_sampling else 0

    @property
    def seq_len(self) -> int:
        return self.num_cached + len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        """One new token after the request's whole known sequence (not a prefill chunk)."""
        return self.is_sampling and len(self.input_ids) - len(self.drafts) == 1 and \
            self.seq_len - len(self.drafts) > self.request.num_prompt_tokens


@dataclass
class ScheduledBatch:
    rows: list[ScheduledRow]

    @property
    def is_empty(self) -> bool:
        return not self.rows

    @cached_property
    def sampling_rows(self) -> list[ScheduledRow]:
        """(Cached: a batch's rows never change once scheduled, and a step reads these often.)"""
        return [row for row in self.rows if row.is_sampling]

    @property
    def num_tokens(self) -> int:
        return sum(len(row.input_ids) for row in self.rows)

    @cached_property
    def num_prefill_tokens(self) -> int:
        """Tokens of the rows that compute more than their one uncached token (prefill chunks)."""
        return sum(n for n in (len(row.input_ids) - len(row.drafts) for row in self.rows) if n > 1)


DraftFn = Callable[[Request, int], list[int]]  # (request, max drafts) -> draft tokens

# Beside decode rows a step takes the waiting prompt tokens over this many steps (TokenBudget);
# 2 shortened the queue but not the throughput (docs/serving.md, "Where it stands")
QUEUE_SPREAD_STEPS = 8


@dataclass(frozen=True)
class TokenBudget:
    """Prefill tokens per step: `with_decode` while decode rows share the step, `alone` when
    none does; beside decode rows, while more prompt tokens wait, an eighth of those waiting
    up to `max_with_decode` (0: `with_decode`, a fixed budget). 1 <= with_decode <=
    max_with_decode <= alone."""

    with_decode: int
    alone: int
    max_with_decode: int = 0

    def __post_init__(self) -> None:
        if not self.max_with_decode:
            object.__setattr__(self, "max_with_decode", self.with_decode)
        if not 1 <= self.with_decode <= self.max_with_decode <= self.alone:
            raise ValueError(f"token budgets must satisfy 1 <= with_decode <= max_with_decode <= alone, got {self}")

    @classmethod
    def fixed(cls, tokens: int) -> "TokenBudget":
        return cls(tokens, tokens)

    def beside_decode(self, num_waiting_tokens: int) -> int:
        """The budget of a step that decode rows share, with this many prompt tokens to
        prefill: an eighth of them (what waits is spread over eight steps, so the steps stay
        even when requests arrive together), between `with_decode` and `max_with_decode`."""
        return min(self.max_with_decode, max(self.with_decode, num_waiting_tokens // QUEUE_SPREAD_STEPS))


class SlotPool:
    """Request pool indices (the step channel's slots); 0..num_slots-1."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} freed twice"
        self._free.append(slot)


class Scheduler:
    def __init__(self, cache: PrefixCache, page_size: int, slots: SlotPool, *,
                 max_batch: int, max_waiting: int, budget: TokenBudget,
                 propose_drafts: DraftFn | None = None,
                 token_bucket: Callable[[int], int] | None = None, step_time: StepTime | None = None,
                 max_step_tokens: int | None = None) -> None:
        self.cache = cache
        self.page_size = page_size
        self.slots = slots
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.budget = budget
        self.propose_drafts = propose_drafts or (lambda request, k: [])
        # The token slots a step of n tokens costs (the runner's graph bucket): prefill fills them
        self.token_bucket = token_bucket or (lambda n: n)
        # Caps the slots of a step that decode rows share at a few plain decode steps' time
        self.step_time = step_time
        # The most tokens a step that decode rows share may hold (the runner's largest mixed
        # graph): a step past it runs eagerly, many times slower (docs/serving.md, "The prefill budget")
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # A late row joins a step whose forward ends after its next mask is likely done: the
        # engine sets this to its recent forward time (late_mask.py; the masks are read then)
        self.mask_lead_s = 0.0
        self.num_preemptions = 0

    # ---- queue ---------------------------------------------------------------------------
    @property
    def num_waiting_new(self) -> int:
        return sum(1 for r in self.waiting if r.status is RequestStatus.WAITING)

    def add(self, request: Request) -> None:
        if self.num_waiting_new >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.running) or any(self._can_start(r) for r in self.waiting)

    # ---- one step ----------------------------------------------------------------------
    def masks_read_at(self) -> float:
        """When a step scheduled now reads its masks: a late row joins it if due by then."""
        return time.monotonic() + self.mask_lead_s

    def schedule(self, max_drafts: int = 0, continuing: list[ScheduledRow] = ()) -> ScheduledBatch:
        """The next step's batch. `continuing`: the decode rows of a chained step (engine.py:
        their requests' tokens of the step in flight are still on the GPU); they come first,
        and then nothing is preempted: a running prefill or a new request that does not fit
        waits for a later step."""
        rows: list[ScheduledRow] = list(continuing)
        can_preempt = not continuing
        now = self.masks_read_at()
        # NOTE: a request with no uncached token gets no row: a continuing one, or one whose
        # token of the step in flight is its last. Left out before the per-request checks,
        # they cost a chained step nothing per row.
        uncached = [r for r in self.running if r.num_uncached]
        num_decode_tokens = len(continuing) + sum(
            1 for r in uncached if r.is_decoding and r.can_sample and r.status is RequestStatus.RUNNING
            and not r.sits_out(now))
        if num_decode_tokens:
            budget = self.budget.beside_decode(self._num_prompt_tokens_to_prefill())
            # the step pays for its whole bucket: padding slots may as well be prompt tokens
            budget = max(budget, self.token_bucket(num_decode_tokens + budget) - num_decode_tokens)
            budget = self._within_step_time(budget, num_decode_tokens)
            if self.max_step_tokens is not None and num_decode_tokens + budget > self.max_step_tokens:
                budget = max(self.max_step_tokens - num_decode_tokens, min(budget, self.budget.with_decode))
        else:
            budget = self.budget.alone
        for request in uncached:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if request.sits_out(now):
                continue  # a late row while its next mask is likely still filled (late_mask.py)
            row = self._schedule_running(request, budget, max_drafts, can_preempt)
            if row is not None:
                rows.append(row)
                if not row.request.is_decoding:
                    budget -= len(row.input_ids)
        for request in list(self.waiting):
            if len(self.running) >= self.max_batch or budget <= 0:
                break
            if not self._can_start(request):
                continue  # compiling with nothing left to prefill: let the next one in
            row = self._admit(request, budget)
            if row is None:
                break
            rows.append(row)
            budget -= len(row.input_ids)
        return ScheduledBatch(rows)

    def _within_step_time(self, budget: int, num_decode_tokens: int) -> int:
        """`budget` cut so the step's slots (its bucket's) stay within `step_time`'s cap; never
        below `with_decode`, the budget that holds whatever the load."""
        max_tokens = self.step_time.max_step_tokens(num_decode_tokens) if self.step_time is not None else None
        if max_tokens is None or self.token_bucket(num_decode_tokens + budget) <= max_tokens:
            return budget
        low, high = 0, max_tokens  # the largest step whose bucket is within the cap
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.token_bucket(mid) <= max_tokens else (low, mid - 1)
        return max(min(budget, low - num_decode_tokens), min(budget, self.budget.with_decode))

    def _num_prompt_tokens_to_prefill(self) -> int:
        """Uncached tokens of the running requests that prefill and of the waiting ones (the
        count stops where the budget reaches its limit)."""
        if self.budget.max_with_decode == self.budget.with_decode:  # a fixed budget: nothing to count
            return 0
        limit = QUEUE_SPREAD_STEPS * self.budget.max_with_decode
        total = 0
        for queue in (self.running, self.waiting):
            for request in queue:
                if not request.is_decoding:
                    total += request.num_uncached
                    if total >= limit:
                        return total
        return total

    def _schedule_running(self, request: Request, budget: int, max_drafts: int,
                          can_preempt: bool = True) -> ScheduledRow | None:
        if request.is_decoding and request.can_sample:
            drafts = self._drafts(request, max_drafts)
            while True:
                if self.reserve(request, request.num_tokens + len(drafts)):
                    return self._row(request, len(request.token_ids) - request.num_cached, drafts)
                if drafts:
                    drafts = []  # no room for speculation: decode plainly first
                    continue
                if not can_preempt or self._preempt_newest() is request:
                    return None
        chunk = self._chunk_len(request, budget)
        if chunk <= 0:
            return None
        while not self.reserve(request, request.num_cached + chunk):
            if not can_preempt or self._preempt_newest() is request:
                return None
        return self._row(request, chunk, [])

    def _admit(self, request: Request, budget: int) -> ScheduledRow | None:
        if request.slot is None and not self.slots.can_allocate():
            return None
        # At least one token is computed (two while compiling: the last one waits to sample).
        hit = self.cache.match(request, request.num_tokens - (1 if request.can_sample else 2))
        chunk = self._chunk_len(request, budget)
        if chunk <= 0 or not self.reserve(request, request.num_cached + chunk):
            self._drop_pages(request)  # (the matched pages stay cached)
            return None
        self.cache.count_lookup(request.num_tokens, hit)
        self.waiting.remove(request)
        if request.slot is None:
            request.slot = self.slots.allocate()
        request.status = RequestStatus.RUNNING
        if request.admitted_s is None:  # a preempted request keeps its first admission
            request.admitted_s = time.monotonic()
            request.num_cached_prompt_tokens = hit
        self.running.append(request)
        return self._row(request, chunk, [])

    def _can_start(self, request: Request) -> bool:
        # A compiling request may prefill all but its last token (it cannot sample yet).
        return request.can_sample or request.num_uncached > 1

    def _chunk_len(self, request: Request, budget: int) -> int:
        limit = request.num_uncached if request.can_sample else request.num_uncached - 1
        return min(limit, budget)

    def _drafts(self, request: Request, max_drafts: int) -> list[int]:
        # Never draft past max_new_tokens: the verifier may accept all drafts plus one token.
        k = min(max_drafts, request.spec.speculative.num_draft_tokens, request.num_remaining - 1)
        return self.propose_drafts(request, k)[:k] if k > 0 else []

    def _row(self, request: Request, chunk: int, drafts: list[int]) -> ScheduledRow:
        start = request.num_cached
        new_ids = request.token_ids[start:start + chunk]
        is_sampling = start + chunk == request.num_tokens and request.can_sample
        return ScheduledRow(request, start, new_ids + drafts, drafts, is_sampling)

    # ---- pages -----------------------------------------------------------------------------
    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Make the request's pages hold `num_tokens` tokens; False if there are not enough."""
        if num_tokens <= len(request.pages) * self.page_size:
            return True  # (most calls: a decode row's page has room)
        need = num_pages_for(num_tokens, self.page_size) - len(request.pages)
        if not self.cache.can_allocate(need):
            return False
        request.pages.extend(self.cache.allocate(need))
        return True

    def trim_pages(self, request: Request) -> None:
        """Free pages past the cached tokens (those of rejected drafts: never keyed, never shared)."""
        keep = num_pages_for(request.num_cached, self.page_size)
        if len(request.pages) > keep:
            self.cache.free(request.pages[keep:])
            del request.pages[keep:]

    def store_pages(self, request: Request) -> None:
        """After a step: key the pages its computed tokens filled, for requests admitted later."""
        self.cache.store(request)

    def _drop_pages(self, request: Request) -> None:
        """Free the request's pages, keying the full ones first (they stay cached)."""
        if request.pages:
            self.cache.store(request)
            self.cache.free(request.pages)
            request.pages = []
        request.num_cached = request.num_stored_pages = 0

    def _preempt_newest(self) -> Request:
        victim = self.running.pop()
        self._drop_pages(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    # ---- end of a request -----------------------------------------------------------------
    def remove(self, request: Request) -> None:
        """Take a finished or cancelled request out, freeing its pages (not its slot)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._drop_pages(request)
