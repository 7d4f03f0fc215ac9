"""RequestStream: what `Engine.submit` returns; iterate it (blocking) for OutputEvents."""
from __future__ import annotations

import queue
from typing import Callable, Iterator

from generation_service.engine.events import OutputEvent


class RequestStream:
    """Events of one request, in order; the last one has `finish_reason` (and `usage`).
    Thread-safe: the engine thread puts, one consumer iterates, anyone may cancel."""

    def __init__(self, request_id: str, cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._events: queue.SimpleQueue[OutputEvent] = queue.SimpleQueue()
        self.is_finished = False  # the final event was put (not necessarily read)

    def put(self, event: OutputEvent) -> None:
        self.is_finished = self.is_finished or event.is_final
        self._events.put(event)

    def __iter__(self) -> Iterator[OutputEvent]:
        while True:
            event = self._events.get()
            yield event
            if event.is_final:
                return

    def get(self, timeout: float | None = None) -> OutputEvent:
        """The next event; raises queue.Empty after `timeout` seconds."""
        return self._events.get(timeout=timeout)

    def cancel(self) -> None:
        """Finish the request as CANCELLED; its slot, pages and matcher are freed at once."""
        self._cancel(self.request_id)
