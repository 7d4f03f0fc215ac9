"""One choice's output as a Responses API `response` object, and its stream of typed events.

The output is a list of items: a `message` with one `output_text` part (the content) and a
`function_call` per tool call. Streamed, each item is opened (`response.output_item.added`),
filled (`response.output_text.delta`, `response.function_call_arguments.delta`) and closed
(`...done`), between `response.created` and `response.completed` (or `response.incomplete`
when max_output_tokens cut the answer), each event numbered by `sequence_number`. The
`structgen` field carries the guarantee report and the final validation, as on chat.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict

from generation_service.assistant.tools import ToolCall
from generation_service.openai_http.outputs import ChoiceOutput, Piece
from generation_service.openai_http.render import ResponseMeta
from generation_service.openai_http.responses import Extension, Model
from generation_service.openai_http.responses_api.schemas import ResponsesRequest


class OutputText(Model):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []
    logprobs: list = []


class MessageItem(Model):
    type: Literal["message"] = "message"
    id: str
    status: str
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(Model):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class ResponseUsage(Model):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(Model):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    error: dict | None
    incomplete_details: dict | None
    model: str
    output: list[MessageItem | FunctionCallItem]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    tool_choice: Any
    tools: list[dict]
    text: dict
    metadata: dict
    store: bool = False  # nothing is stored here, whatever the request's `store`
    structgen: Extension | None = None


class Event(Model):
    type: str
    sequence_number: int
    model_config = ConfigDict(extra="allow")


class ResponsesFormat:
    """exchange.Format of one Responses API answer (one choice)."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.body = body
        self._num_events = 0
        self._items: list[str] = []  # "message" or a call id, in the order they were opened

    def whole(self, meta: ResponseMeta, outputs: list[ChoiceOutput]) -> ResponseObject:
        [output] = outputs
        if output.text or not output.tool_calls:
            self._items.append("message")
        self._items += [call.id for call in output.tool_calls]
        return self._response(meta, output)

    def opening(self, meta: ResponseMeta, outputs: list[ChoiceOutput]) -> list[Event]:
        snapshot = self._response(meta, None)
        return [self._event("response.created", response=snapshot), self._event("response.in_progress",
                                                                                 response=snapshot)]

    def chunks(self, meta: ResponseMeta, output: ChoiceOutput, piece: Piece) -> list[Event]:
        events = []
        if piece.text:
            if "message" not in self._items:
                events += self._open_message(meta)
            events.append(self._event("response.output_text.delta", item_id=self._message_id(meta),
                                      output_index=self._items.index("message"), content_index=0,
                                      delta=piece.text, logprobs=[]))
        for call in piece.tool_calls:
            events += self._call_events(meta, call)
        if piece.is_final:
            if "message" not in self._items and not output.tool_calls:  # an empty answer is an empty message
                events += self._open_message(meta)
            events += self._close_message(meta, output) + self._closing(meta, output)
        return events

    def usage_chunk(self, meta: ResponseMeta, outputs: list[ChoiceOutput]) -> Event:
        raise NotImplementedError("the Responses API sends its usage in response.completed")

    def _event(self, kind: str, **fields) -> Event:
        event = Event(type=kind, sequence_number=self._num_events, **fields)
        self._num_events += 1
        return event

    def _message_id(self, meta: ResponseMeta) -> str:
        return f"msg_{meta.id.removeprefix('resp_')}"

    def _open_message(self, meta: ResponseMeta) -> list[Event]:
        self._items.append("message")
        index = len(self._items) - 1
        item = MessageItem(id=self._message_id(meta), status="in_progress", content=[])
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=item.id, output_index=index, content_index=0,
                            part=OutputText(text=""))]

    def _call_events(self, meta: ResponseMeta, call: ToolCall) -> list[Event]:
        self._items.append(call.id)
        index = len(self._items) - 1
        item = _call_item(call, "in_progress")
        return [self._event("response.output_item.added", output_index=index, item=item.model_copy(
                    update={"arguments": ""})),
                self._event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                            delta=call.arguments),
                self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                            arguments=call.arguments),
                self._event("response.output_item.done", output_index=index, item=_call_item(call, "completed"))]

    def _close_message(self, meta: ResponseMeta, output: ChoiceOutput) -> list[Event]:
        if "message" not in self._items:
            return []
        index, part = self._items.index("message"), OutputText(text=output.text)
        item = _message_item(self._message_id(meta), output)
        return [self._event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                            text=output.text, logprobs=[]),
                self._event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _closing(self, meta: ResponseMeta, output: ChoiceOutput) -> list[Event]:
        response = self._response(meta, output)
        return [self._event(f"response.{response.status}", response=response)]

    def _response(self, meta: ResponseMeta, output: ChoiceOutput | None) -> ResponseObject:
        """The response object: in progress (no output yet) or finished."""
        body = self.body
        is_cut = output is not None and output.finish_reason == "length"
        items = [] if output is None else [
            _message_item(self._message_id(meta), output) if key == "message" else
            _call_item(next(c for c in output.tool_calls if c.id == key), "completed") for key in self._items]
        extension = None if output is None else output.extension()
        return ResponseObject(
            id=meta.id, created_at=meta.created, model=meta.model, output=items, error=None,
            status="in_progress" if output is None else "incomplete" if is_cut else "completed",
            incomplete_details={"reason": "max_output_tokens"} if is_cut else None,
            usage=None if output is None else _usage(output), instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, parallel_tool_calls=body.parallel_tool_calls,
            temperature=body.temperature, top_p=body.top_p,
            tool_choice=body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump")
            else body.tool_choice or "auto",
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
            text=body.text.model_dump(exclude_none=True, by_alias=True) if body.text else {"format": {"type": "text"}},
            metadata=body.metadata or {}, **({"structgen": Extension(**extension)} if extension else {}))


def _message_item(item_id: str, output: ChoiceOutput) -> MessageItem:
    status = "incomplete" if output.finish_reason == "length" else "completed"
    return MessageItem(id=item_id, status=status, content=[OutputText(text=output.text)])


def _call_item(call: ToolCall, status: str) -> FunctionCallItem:
    return FunctionCallItem(id=f"fc_{call.id.removeprefix('call_')}", call_id=call.id, name=call.name,
                            arguments=call.arguments, status=status)


def _usage(output: ChoiceOutput) -> ResponseUsage:
    usage = output.usage
    prompt, completion = (usage.prompt_tokens, usage.completion_tokens) if usage is not None else (0, 0)
    return ResponseUsage(input_tokens=prompt,
                         input_tokens_details={"cached_tokens": usage.cached_prompt_tokens if usage else 0},
                         output_tokens=completion, output_tokens_details={"reasoning_tokens": 0},
                         total_tokens=prompt + completion)
