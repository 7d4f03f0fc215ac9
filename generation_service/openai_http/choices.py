"""The engine side of one HTTP request: its choices' RequestStreams as one asyncio stream.

`Engine.submit` returns a blocking `RequestStream` (the gRPC servicer iterates it on its rpc
thread). Here each choice gets a pump thread that iterates it the same way, through the
same metrics observer and the same final JSON-Schema validation, and hands each event to
the event loop (`call_soon_threadsafe`, one wake-up per coalesced event). The thread ends
with the request's final event, which the engine always sends: on finish, on `cancel`
(client disconnect) and on engine shutdown.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import AsyncIterator

from generation_service import metrics
from generation_service.assistant.parser import TurnPiece
from generation_service.assistant.turn import AssistantTurn
from generation_service.engine.events import OutputEvent
from generation_service.engine.params import GenerationRequest
from structgen.schema_validation import ValidationResult, validate_output

log = logging.getLogger("structgen.http")


@dataclass(frozen=True)
class ChoiceEvent:
    index: int
    event: OutputEvent
    validation: ValidationResult | None = None  # the final event of a json_schema request
    piece: TurnPiece | None = None              # the event's text split by the turn's parser


class ChoiceStreams:
    """Submits one engine request per choice; `events()` yields theirs in arrival order.
    With a turn (reasoning, tools) each pump thread parses its choice's text as it goes, and
    the final validation covers the content alone."""

    def __init__(self, engine, specs: list[GenerationRequest], turn: AssistantTurn | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        self._streams = []
        self.specs = specs
        self._turn = turn
        try:
            for spec in specs:
                self._streams.append(engine.submit(spec))
        except BaseException:
            self.cancel()
            raise
        self._num_open = len(specs)
        for index, (spec, stream) in enumerate(zip(specs, self._streams)):
            threading.Thread(target=self._pump, args=(index, spec, stream), daemon=True,
                             name=f"http-{spec.request_id}").start()

    def _pump(self, index: int, spec: GenerationRequest, stream) -> None:
        schema = spec.grammar.text if spec.grammar is not None and spec.grammar.kind == "json_schema" else None
        parser = self._turn.parser() if self._turn is not None else None
        texts: list[str] = []
        for event in metrics.get().observe(stream.coalesced(), spec):
            validation, piece = None, None
            if parser is not None:
                piece = parser.feed(event.text, final=event.is_final)
            if schema is not None:
                texts.append(event.text if piece is None else piece.content)
                if event.is_final:  # the whole output against the full schema, as on gRPC
                    validation = validate_output(schema, "".join(texts))
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, ChoiceEvent(index, event, validation, piece))
            except RuntimeError:  # the event loop is closed (server stopped): nobody reads
                stream.cancel()
                return

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's events until each has sent its final one."""
        while self._num_open:
            item = await self._queue.get()
            if item.event.is_final:
                self._num_open -= 1
            yield item

    def cancel(self) -> None:
        """Cancel every choice still running (a no-op for finished ones)."""
        for stream in self._streams:
            stream.cancel()
