"""RequestStream: what `Engine.submit` returns; iterate it for OutputEvents, blocking on a
thread (`batches`) or awaiting on an asyncio loop (`abatches`)."""
from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from typing import AsyncIterator, Callable, Iterator

from generation_service.engine.events import OutputEvent


class RequestStream:
    """Events of one request, in order; the last one has `finish_reason` (and `usage`).
    Thread-safe: the engine thread puts, one consumer iterates, anyone may cancel.

    The engine `push`es a step's token events without waking anyone and `wake`s each stream
    once the step's rows are done: a consumer woken per row would take the GIL from the
    engine thread in the middle of the step (benchmarks/engine_host.py). `wake` only costs a
    futex call when the consumer is blocked; one that is behind finds the events queued.
    An asyncio consumer (`abatches`) costs no thread: the streams woken in one step resume
    on their loop through the same `LoopWaker` call."""

    def __init__(self, request_id: str, cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._events: collections.deque[OutputEvent] = collections.deque()
        self._wakeup = threading.Lock()  # held while nobody is to be woken; released to wake
        self._wakeup.acquire()
        self._is_waiting = False  # the consumer is (about to be) blocked on `_wakeup` / `_resumed`
        self._waker: LoopWaker | None = None          # set while an asyncio consumer reads
        self._resumed: asyncio.Future | None = None   # what that consumer awaits
        self.is_finished = False  # the final event was put (not necessarily read)

    # ---- engine side ---------------------------------------------------------------------------
    def push(self, event: OutputEvent) -> None:
        """Queue an event without waking the consumer; `wake` must follow."""
        if event.finish_reason is not None:  # (`is_final`, without a property call per event)
            self.is_finished = True
        self._events.append(event)

    def wake(self) -> None:
        """Wake the consumer if it is blocked (events were pushed)."""
        # NOTE: push appends before this reads `_is_waiting`, and `_wait` sets it before it
        # reads `_events`: one of the two sees the other, so no wake-up is lost.
        if self._is_waiting:
            self._is_waiting = False
            if self._waker is not None:
                self._waker.wake(self)
                return
            try:
                self._wakeup.release()
            except RuntimeError:  # released already: the consumer's next acquire returns at once
                pass

    def put(self, event: OutputEvent) -> None:
        self.push(event)
        self.wake()

    # ---- consumer side -------------------------------------------------------------------------
    def _wait(self, timeout: float | None) -> bool:
        """Block until an event is queued; False after `timeout` seconds. May return early."""
        self._is_waiting = True
        if self._events:
            self._is_waiting = False
            return True
        woken = self._wakeup.acquire(timeout=-1 if timeout is None else max(timeout, 0))
        self._is_waiting = False
        return woken

    def __iter__(self) -> Iterator[OutputEvent]:
        for events in self.batches():
            yield from events

    def batches(self) -> Iterator[list[OutputEvent]]:
        """All events queued at each wake-up, in order, until the final one (last)."""
        events = self._events
        while True:
            if not events:
                self._wait(None)
                continue
            batch = [events.popleft() for _ in range(len(events))]
            yield batch
            if batch[-1].is_final:
                return

    def coalesced(self) -> Iterator[OutputEvent]:
        """Like iterating, but the token events queued together come as one (see `coalesce`)."""
        for batch in self.batches():
            yield from coalesce(batch)

    async def abatches(self) -> AsyncIterator[list[OutputEvent]]:
        """`batches` for a consumer on the running asyncio loop: it awaits instead of blocking
        a thread. One consumer at a time, as for `batches`."""
        loop = asyncio.get_running_loop()
        self._waker = LoopWaker.of(loop)
        events = self._events
        while True:
            if not events:
                # NOTE: the future exists before `_is_waiting` is set, and the loop runs nothing
                # else before the check below: a wake-up that follows it finds the future.
                self._resumed = loop.create_future()
                self._is_waiting = True
                if not events:
                    await self._resumed
                self._is_waiting = False
                continue
            batch = [events.popleft() for _ in range(len(events))]
            yield batch
            if batch[-1].is_final:
                return

    async def acoalesced(self) -> AsyncIterator[OutputEvent]:
        """`coalesced` on the running asyncio loop."""
        async for batch in self.abatches():
            for event in coalesce(batch):
                yield event

    def _resume(self) -> None:
        """On the consumer's loop: let `abatches` look at the queue again."""
        resumed = self._resumed
        if resumed is not None and not resumed.done():
            resumed.set_result(None)

    def get(self, timeout: float | None = None) -> OutputEvent:
        """The next event; raises queue.Empty after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._events:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise queue.Empty
            self._wait(remaining)
        return self._events.popleft()

    def cancel(self) -> None:
        """Finish the request as CANCELLED; its slot, pages and matcher are freed at once."""
        self._cancel(self.request_id)


class LoopWaker:
    """Resumes the asyncio consumers that the engine thread woke, one loop call per batch of
    wake-ups: a wake-up that finds a call pending joins it, so the streams woken in one step
    cost one `call_soon_threadsafe` (a write to the loop's self-pipe) together, or a few when
    the loop runs in between, not one each."""

    _by_loop: dict[asyncio.AbstractEventLoop, "LoopWaker"] = {}
    _by_loop_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[RequestStream] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopWaker":
        """The loop's one waker (made on first use; dropped with a closed loop's next lookup)."""
        with cls._by_loop_lock:
            waker = cls._by_loop.get(loop)
            if waker is None:
                for closed in [other for other in cls._by_loop if other.is_closed()]:
                    del cls._by_loop[closed]
                waker = cls._by_loop[loop] = cls(loop)
            return waker

    def wake(self, stream: RequestStream) -> None:
        """Any thread: resume `stream`'s consumer soon."""
        with self._lock:
            self._pending.append(stream)
            is_first = len(self._pending) == 1
        if is_first:
            try:
                self._loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop is closed: nobody is left to read
                with self._lock:
                    self._pending.clear()

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for stream in pending:
            stream._resume()


def coalesce(events: list[OutputEvent]) -> list[OutputEvent]:
    """Merge each run of consecutive plain token events into one event with all their tokens,
    text and logprobs (a GenerateResponse carries "the tokens since the previous message").
    Events with a guarantee, a finish reason or an error stay as they are, in place: tokens
    are never moved into the final event, so a failed request still sends them first."""
    merged: list[OutputEvent] = []
    run: list[OutputEvent] = []
    for event in events:
        if is_plain_tokens(event):
            run.append(event)
            continue
        if run:
            merged.append(_merge(run))
            run = []
        merged.append(event)
    if run:
        merged.append(_merge(run))
    return merged


def is_plain_tokens(event: OutputEvent) -> bool:
    """Tokens and text only: no guarantee, finish, error or usage (what `coalesce` merges)."""
    return (event.finish_reason is None and event.guarantee is None and event.error is None
            and event.usage is None)


def _merge(run: list[OutputEvent]) -> OutputEvent:
    if len(run) == 1:
        return run[0]
    return OutputEvent.of_tokens(tuple(t for event in run for t in event.token_ids),
                                 "".join(event.text for event in run),
                                 tuple(lp for event in run for lp in event.logprobs))
