"""Tool calls: the grammar that enforces them and the parser that reads them back.

One tool-call syntax, the Hermes / Qwen one that many chat templates prompt for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammar is a `structural_tag` constraint (compiled by grammar_service like any other):
each tool is a tag whose begin text fixes its name and whose content is its `parameters`
schema, so a call always names a listed tool with arguments valid for it. tool_choice
"auto": free text, and once the model writes `<tool_call>` the call is enforced
(`triggered_tags`); "required" and a named function: only calls, at least one
(`tags_with_separator`). parallel_tool_calls false: at most one call. Because the grammar
fixes the syntax, the parser needs no heuristics: what it finds between the markers parses.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from generation_service.engine.errors import InvalidRequestError
from generation_service.openai_http.schemas import ChatCompletionRequest, Tool

BEGIN = "<tool_call>"
END = "</tool_call>"
_CALL_PREFIX = BEGIN + '\n{"name": "'
_ARGUMENTS_PREFIX = '", "arguments": '
_CALL_SUFFIX = "}\n" + END
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def tools_grammar(request: ChatCompletionRequest) -> str | None:
    """The structural-tag JSON that enforces the request's tool calls; None when tools are
    absent or tool_choice is "none". Raises InvalidRequestError for a choice no tool has."""
    tools, choice = request.tools or [], request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools")
        return None
    if choice == "none":
        return None
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"tools: function names must be unique, got {names}")
    single = not request.parallel_tool_calls
    max_whitespace = _max_whitespace(request)
    if choice is None or choice == "auto":
        format_ = {"type": "triggered_tags", "triggers": [BEGIN], "tags": [_tag(t, max_whitespace) for t in tools],
                   "at_least_one": False, "stop_after_first": single}
    else:
        if choice == "required":
            chosen = tools
        else:
            chosen = [t for t in tools if t.function.name == choice.function.name]
            if not chosen:
                raise InvalidRequestError(f"tool_choice names function {choice.function.name!r}, "
                                          f"which is not among tools {names}")
            single = True
        format_ = {"type": "tags_with_separator", "tags": [_tag(t, max_whitespace) for t in chosen],
                   "separator": "\n",
                   "at_least_one": True, "stop_after_first": single}
    return json.dumps({"type": "structural_tag", "format": format_})


def _max_whitespace(request: ChatCompletionRequest) -> int | None:
    """The cap on whitespace runs in arguments. A structural tag's JSON content takes a cap of
    at least 1 and has no compact mode, so those two are refused rather than weakened."""
    options = request.structgen
    if options.compact:
        raise InvalidRequestError("structgen.compact does not apply to tool-call arguments; "
                                  "use structgen.max_whitespace (>= 1)")
    if options.max_whitespace == 0:
        raise InvalidRequestError("structgen.max_whitespace must be >= 1 with tools")
    return options.max_whitespace


def forces_calls(request: ChatCompletionRequest) -> bool:
    """tool_choice "required" or a named function: the output is calls only."""
    return request.tool_choice not in (None, "none", "auto")


def _tag(tool: Tool, max_whitespace: int | None) -> dict:
    """One tool's call; `max_whitespace` caps whitespace runs in its arguments."""
    schema = tool.function.parameters if tool.function.parameters is not None else _ANY_OBJECT
    content = {"type": "json_schema", "json_schema": schema}
    if max_whitespace is not None:
        content["max_whitespace_cnt"] = max_whitespace
    return {"type": "tag", "begin": _CALL_PREFIX + tool.function.name + _ARGUMENTS_PREFIX,
            "content": content, "end": _CALL_SUFFIX}


@dataclass
class ToolCallParser:
    """Splits streamed text into content and completed tool calls, as the text arrives.

    Text that may still turn out to be the start of `<tool_call>` is held back; a call is
    returned once its `</tool_call>` arrived. `finish` returns what is left as content (a
    call cut off by max_tokens is not a call)."""

    only_calls: bool = False  # "required" / named: text between calls is the separator
    _buffer: str = ""
    _in_call: bool = False
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, found = [], []
        while True:
            if self._in_call:
                end = self._buffer.find(END)
                if end < 0:
                    break
                call = _parse_call(self._buffer[:end])
                if call is None:  # not a call after all: it stays text
                    content.append(BEGIN + self._buffer[:end + len(END)])
                else:
                    found.append(call)
                self._buffer, self._in_call = self._buffer[end + len(END):], False
                continue
            begin = self._buffer.find(BEGIN)
            if begin < 0:
                keep = _held_back_len(self._buffer)
                content.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content.append(self._buffer[:begin])
            self._buffer, self._in_call = self._buffer[begin + len(BEGIN):], True
        self.calls += found
        text = "".join(content)
        return ("" if self.only_calls and not text.strip() else text), found

    def finish(self) -> str:
        """Text still held back (a partial marker, or a call cut off), as content."""
        rest = (BEGIN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return "" if self.only_calls and not rest.strip() else rest


def _held_back_len(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of BEGIN."""
    for n in range(min(len(BEGIN) - 1, len(text)), 0, -1):
        if text.endswith(BEGIN[:n]):
            return n
    return 0


def _parse_call(body: str) -> ToolCall | None:
    """`{"name": ..., "arguments": ...}` between the markers; the grammar makes it so, None
    when something else is there (an unconstrained backend, a model writing the marker)."""
    try:
        call = json.loads(body)
        name, arguments = call["name"], call["arguments"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str):
        return None
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name,
                    arguments=json.dumps(arguments, ensure_ascii=False))


def template_tools(request: ChatCompletionRequest) -> list[dict] | None:
    """The tools as chat templates read them (the OpenAI shape, as plain dicts)."""
    if not request.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools]
