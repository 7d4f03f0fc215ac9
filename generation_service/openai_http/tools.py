"""OpenAI chat bodies -> the assistant turn (generation_service/assistant/): tools,
tool_choice, parallel_tool_calls and the reasoning options.

The grammar that enforces calls and the parser that reads them back live in the shared
package, which the gRPC API uses too; here are only the OpenAI spellings: `tools` of
function tools, `tool_choice` "none" / "auto" / "required" / {"type": "function", ...},
and reasoning from `structgen.reasoning` or `chat_template_kwargs.enable_thinking`.
"""
from __future__ import annotations

from generation_service.assistant.reasoning import ReasoningRequest
from generation_service.assistant.tools import Tool, ToolChoice
from generation_service.assistant.turn import AssistantTurn, plan_turn
from generation_service.engine.errors import InvalidRequestError
from generation_service.openai_http.errors import ApiError
from generation_service.openai_http.schemas import ChatCompletionRequest


def domain_tools(request: ChatCompletionRequest) -> tuple[Tool, ...]:
    return tuple(Tool(t.function.name, t.function.description or "", t.function.parameters)
                 for t in request.tools or [])


def domain_choice(request: ChatCompletionRequest) -> ToolChoice | None:
    choice = request.tool_choice
    if choice is None:
        return None
    if isinstance(choice, str):
        return ToolChoice(choice)
    return ToolChoice("named", choice.function.name)


def reasoning_request(request: ChatCompletionRequest) -> ReasoningRequest | None:
    """structgen.reasoning, else chat_template_kwargs.enable_thinking (vLLM's spelling)."""
    options = request.structgen.reasoning
    if options is not None:
        mode = "default" if options.enabled is None else ("enabled" if options.enabled else "disabled")
        try:
            return ReasoningRequest(mode, options.max_tokens, options.begin_marker or "", options.end_marker or "")
        except ValueError as error:
            raise ApiError(400, f"structgen.reasoning: {error}", param="structgen.reasoning") from None
    flag = (request.chat_template_kwargs or {}).get("enable_thinking")
    if isinstance(flag, bool):
        return ReasoningRequest("enabled" if flag else "disabled")
    return None


def template_kwargs(request: ChatCompletionRequest) -> dict | None:
    """chat_template_kwargs, with enable_thinking as the reasoning options set it."""
    kwargs = dict(request.chat_template_kwargs or {})
    reasoning = reasoning_request(request)
    if reasoning is not None and reasoning.enable_thinking is not None:
        kwargs["enable_thinking"] = reasoning.enable_thinking
    return kwargs or None


def template_tools(request: ChatCompletionRequest) -> list[dict] | None:
    """The tools as chat templates read them (the OpenAI shape, as plain dicts)."""
    if not request.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


def chat_turn(request: ChatCompletionRequest, tokenizer, prompt_ids: tuple[int, ...]) -> AssistantTurn | None:
    """The turn of a chat request (None without tools and reasoning); raises InvalidRequestError."""
    if not request.tools and request.tool_choice in (None, "none") and reasoning_request(request) is None:
        return None
    try:
        return plan_turn(tokenizer, prompt_ids, tools=domain_tools(request), choice=domain_choice(request),
                         single_call=not request.parallel_tool_calls, reasoning=reasoning_request(request))
    except ValueError as error:
        raise InvalidRequestError(str(error)) from None
