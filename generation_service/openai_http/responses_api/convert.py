"""A Responses API request as the chat completion it asks for: `instructions` and the `input`
items become messages (a run of function_call items one assistant turn with its tool calls,
a function_call_output a tool turn), `text.format` the response_format, the flat function
tools OpenAI's chat tools. From there the chat path serves it (template, tools, grammar).
"""
from __future__ import annotations

from generation_service.openai_http.errors import ApiError
from generation_service.openai_http.responses_api.schemas import (FunctionCallItem, FunctionCallOutputItem,
                                                                  InputMessage, ResponsesRequest)
from generation_service.openai_http.schemas import (ChatCompletionRequest, ChatMessage, FunctionCall,
                                                    FunctionDefinition, NamedFunction, NamedToolChoice,
                                                    ResponseFormat, Tool, ToolCall)

# parameters that change what a server does, which this one cannot do: refused unless neutral
_REFUSED = {
    "previous_response_id": "responses are not stored here (stateless); send the whole conversation in input",
    "background": "background responses are not supported",
    "reasoning": "reasoning options are not supported here; use structgen.reasoning on /v1/chat/completions",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "max_tool_calls is not supported; use parallel_tool_calls",
}


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request `body` stands for; raises ApiError naming a refused parameter."""
    for name, reason in _REFUSED.items():
        if getattr(body, name) not in (None, False, 0):
            raise ApiError(400, f"{name} is not supported by this server: {reason}", param=name)
    if body.structgen.reasoning is not None:
        raise ApiError(400, "structgen.reasoning is not supported on /v1/responses yet; use /v1/chat/completions",
                       param="structgen.reasoning")
    return ChatCompletionRequest(
        model=body.model, messages=messages(body), max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, response_format=_response_format(body),
        tools=[Tool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in body.tools]
        if body.tools else None,
        tool_choice=_tool_choice(body), parallel_tool_calls=body.parallel_tool_calls, structgen=body.structgen)


def messages(body: ResponsesRequest) -> list[ChatMessage]:
    turns = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, InputMessage):
            content = item.content if isinstance(item.content, str) else "".join(part.text for part in item.content)
            turns.append(ChatMessage(role=item.role, content=content))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if turns and turns[-1].role == "assistant" and turns[-1].tool_calls:  # parallel calls: one turn
                turns[-1].tool_calls.append(call)
            else:
                turns.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            turns.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    return turns


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    text_format = body.text.format if body.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return ResponseFormat(type="json_object")
    if text_format.json_schema is None:
        raise ApiError(400, "text.format json_schema needs its schema", param="text.format.schema")
    return ResponseFormat(type="json_schema", json_schema=text_format.as_json_schema_format())


def _tool_choice(body: ResponsesRequest):
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
