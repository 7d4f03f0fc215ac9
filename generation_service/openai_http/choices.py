"""The engine side of one HTTP request: its choices' RequestStreams as one asyncio stream.

Each choice gets a task on the front's event loop that awaits its `RequestStream`
(`acoalesced`: no thread per choice) through the same metrics observer and the same final
JSON-Schema validation as the gRPC servicer, and puts each event on one queue. The task ends
with the request's final event, which the engine always sends: on finish, on `cancel`
(client disconnect) and on engine shutdown.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
from dataclasses import dataclass
from typing import AsyncIterator

from generation_service import metrics
from generation_service.assistant.parser import TurnPiece
from generation_service.assistant.turn import AssistantTurn
from generation_service.engine.events import FinishReason, OutputEvent
from generation_service.engine.params import GenerationRequest
from structgen.schema_validation import ValidationResult, validate_output

log = logging.getLogger("structgen.http")
_FAILED = (FinishReason.ERROR, FinishReason.DEADLINE, FinishReason.CANCELLED)


@dataclass(frozen=True)
class ChoiceEvent:
    index: int
    event: OutputEvent
    validation: ValidationResult | None = None  # the final event of a json_schema request
    piece: TurnPiece | None = None              # the event's text split by the turn's parser


class ChoiceStreams:
    """Submits one engine request per choice; `events()` yields theirs in arrival order.
    With a turn (reasoning, tools) each choice's task parses its text as it goes, and the
    final validation covers the content alone. Made on the event loop that reads it."""

    def __init__(self, engine, specs: list[GenerationRequest], turn: AssistantTurn | None = None) -> None:
        self._queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        self._streams = []
        self.specs = specs
        self._turn = turn
        self._tokenizer = engine.tokenizer if turn is not None else None
        try:
            for spec in specs:
                self._streams.append(engine.submit(spec))
        except BaseException:
            self.cancel()
            raise
        self._num_open = len(specs)
        # NOTE: the tasks start from an empty context, not the request's: the HTTP span gets the
        # answer's usage and finish reasons once, from the exchange (observability.py).
        self._pumps = [contextvars.Context().run(asyncio.ensure_future, self._pump(index, spec, stream))
                       for index, (spec, stream) in enumerate(zip(specs, self._streams))]

    async def _pump(self, index: int, spec: GenerationRequest, stream) -> None:
        schema = spec.grammar.text if spec.grammar is not None and spec.grammar.kind == "json_schema" else None
        parser = self._turn.parser(self._tokenizer, spec.prompt_ids) if self._turn is not None else None
        observer = metrics.get().observer(spec)
        texts: list[str] = []
        try:
            async for event in stream.acoalesced():
                observer.event(event)
                validation, piece = None, None
                if parser is not None:
                    piece = parser.feed(event.text, event.is_final, event.token_ids)
                if schema is not None:
                    texts.append(event.text if piece is None else piece.content)
                    if event.is_final:  # the whole output against the full schema, as on gRPC
                        validation = validate_output(schema, "".join(texts),
                                                     event.finish_reason is FinishReason.MAX_TOKENS)
                        if event.finish_reason not in _FAILED:  # (a failed request's output was no answer)
                            observer.validated("json_schema", validation)
                for call in piece.calls if piece is not None else ():
                    observer.validated("tool_call", self._turn.validate(call))
                self._queue.put_nowait(ChoiceEvent(index, event, validation, piece))
        finally:
            if not stream.is_finished:  # the task was cancelled (server stopped): free the request
                stream.cancel()

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
