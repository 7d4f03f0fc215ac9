"""SlowFiller: mask fills of slow rows, off the step's path (docs/step_channel.md, "Late rows").

A row whose mask takes long to fill (an adversarial grammar state) would hold every other row
of its step: the loop publishes all masks of a step at once. Its fills run here instead, one
row at a time in a thread of their own, into a private mask row; SlowRows (slow_rows.py) copies
a finished fill into the step's entry, and marks the row late (VALID_LATE) when its fill is not
done by the time the engine's forward of the step is. A late row is not advanced (the engine
sampled nothing for it), so the fill stays valid for the next step, which uses it once done.

NUM_THREADS threads, each one fill at a time: a row is slow against the engine's forward, which
on a small model is well under a millisecond, so a row of an ordinary schema is slow in its
string states, and one thread would queue such a millisecond fill behind an adversarial row's
(the GPU slow-row test's others then sat out at its pace).
The backends' fills run with the GIL released (xgrammar's binding, llguidance's executor), so the
loop thread runs beside them.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from grammar_service.backends.base import GrammarBackend, Matcher

log = logging.getLogger(__name__)

NUM_THREADS = 4  # slow fills at once; a fifth waits for one of them


@dataclass(eq=False)
class SlowFill:
    """One slow row's mask of one matcher state; `done` is set once `mask` (or `error`) is final."""

    matcher: Matcher
    backend: GrammarBackend
    delay_s: float                  # GrammarServiceConfig.slow_fill_ms of its grammar (tests)
    mask: np.ndarray                # (1, mask_words) int32, private to this fill
    done: threading.Event = field(default_factory=threading.Event)
    elapsed_ns: int = 0
    error: BaseException | None = None


class SlowFiller:
    """Threads that fill SlowFills, started in submission order; `close` ends them. A row has
    one fill under way at most (SlowRows), so no matcher is filled by two threads at once."""

    def __init__(self, mask_words: int, name: str, num_threads: int = NUM_THREADS):
        self.mask_words = mask_words
        self._queue: queue.SimpleQueue[SlowFill | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"slow-filler-{name}-{i}", daemon=True)
                         for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, matcher: Matcher, backend: GrammarBackend, delay_s: float = 0.0) -> SlowFill:
        fill = SlowFill(matcher, backend, delay_s, np.full((1, self.mask_words), -1, np.int32))
        self._queue.put(fill)
        return fill

    def close(self, timeout_s: float = 5.0) -> None:
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))

    def _run(self) -> None:
        while (fill := self._queue.get()) is not None:
            started = time.perf_counter_ns()
            try:
                if fill.delay_s:
                    time.sleep(fill.delay_s)
                fill.backend.fill_alone(fill.matcher, fill.mask, 0)
            except Exception as error:  # noqa: BLE001 -- the loop fails this row alone
                log.exception("slow fill failed")
                fill.error = error
            fill.elapsed_ns = time.perf_counter_ns() - started
            fill.done.set()
