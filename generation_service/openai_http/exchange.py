"""One request/response exchange: submit the choices, then answer with one JSON body or a
stream of server-sent events, cancelling the engine requests when the client goes away.

A stream starts only once every choice has sent its first event (its guarantee report, its
first tokens, or its error): a bad schema or a full queue is then still an HTTP error with
its status, never a 200 whose body says "error". Later failures arrive as an `error` event
(`data: {"error": {...}}`), which the OpenAI SDKs raise as an APIError.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from generation_service.openai_http import observability
from generation_service.openai_http.choices import ChoiceStreams
from generation_service.openai_http.errors import ApiError
from generation_service.openai_http.observability import CLIENT_CLOSED
from generation_service.openai_http.outputs import ChoiceOutput, Piece
from generation_service.openai_http.render import ResponseMeta, usage
from generation_service.openai_http.responses import Model


class Format(Protocol):
    """Chat, text completion or Responses API: how outputs and pieces become bodies and events."""

    def whole(self, meta: ResponseMeta, outputs: list[ChoiceOutput]) -> Model: ...
    def opening(self, meta: ResponseMeta, outputs: list[ChoiceOutput]) -> list[Model]: ...
    def chunks(self, meta: ResponseMeta, output: ChoiceOutput, piece: Piece) -> list[Model]: ...
    def usage_chunk(self, meta: ResponseMeta, outputs: list[ChoiceOutput]) -> Model: ...


@dataclass
class Exchange:
    request: Request
    streams: ChoiceStreams
    outputs: list[ChoiceOutput]
    meta: ResponseMeta
    format: Format
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage

    async def respond(self, stream: bool) -> Response:
        events = self.streams.events()
        try:
            if not stream:
                try:
                    return await self._whole(events)
                finally:
                    self._end()
            first = await self._first_pieces(events)
        except BaseException:
            self._end()
            raise
        return StreamingResponse(self._sse(events, first), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def _whole(self, events) -> Response:
        async def collect():
            async for item in events:
                self.outputs[item.index].add(item)

        collecting = asyncio.ensure_future(collect())
        left = asyncio.ensure_future(_disconnected(self.request))
        try:
            await asyncio.wait({collecting, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
        if not collecting.done():  # the client is gone: free the engine requests now
            collecting.cancel()
            self.streams.cancel()
            return Response(status_code=CLIENT_CLOSED)
        collecting.result()  # raises a failed choice's error
        self._annotate()
        return JSONResponse(self.format.whole(self.meta, self.outputs).dump())

    async def _first_pieces(self, events: AsyncIterator) -> list[tuple[ChoiceOutput, Piece]]:
        pieces, waiting = [], {output.index for output in self.outputs}
        while waiting:
            item = await events.__anext__()
            output = self.outputs[item.index]
            pieces.append((output, output.add(item)))
            waiting.discard(item.index)
        return pieces

    async def _sse(self, events: AsyncIterator, first: list[tuple[ChoiceOutput, Piece]]):
        meta, format_ = self.meta, self.format
        try:
            for chunk in format_.opening(meta, self.outputs):
                yield _event(chunk)
            for output, piece in first:
                for chunk in format_.chunks(meta, output, piece):
                    yield _event(chunk)
            async for item in events:
                output = self.outputs[item.index]
                try:
                    piece = output.add(item)
                except Exception as error:  # noqa: BLE001 -- reported in the stream, then it ends
                    failure = ApiError.of(error)
                    observability.mark_failed(failure.message)
                    yield f"data: {json.dumps(failure.body())}\n\n"
                    return
                for chunk in format_.chunks(meta, output, piece):
                    yield _event(chunk)
            if self.include_usage:
                yield _event(format_.usage_chunk(meta, self.outputs))
            self._annotate()
            yield "data: [DONE]\n\n"
        finally:  # finished, failed, or the client left (the task is cancelled): free what is left
            self._end()

    def _annotate(self) -> None:
        reasons = [o.engine_reason.value for o in self.outputs if o.engine_reason is not None]
        observability.annotate_response(usage(self.meta, self.outputs), reasons)

    def _end(self) -> None:
        self.streams.cancel()
        observability.end_choices(self.streams.specs)


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(chunk: Model) -> str:
    return f"data: {chunk.dump_json()}\n\n"
