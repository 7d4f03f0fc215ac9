"""proto <-> the assistant turn (generation_service/assistant/): tools, tool choice and
reasoning options of a request; parsed calls and reasoning text of a response. No grpc calls,
no torch. Raises InvalidRequestError (-> INVALID_ARGUMENT) with the field named.
"""
from __future__ import annotations

from generation_service.assistant.formats import detect_format
from generation_service.assistant.parser import TurnPiece
from generation_service.assistant.reasoning import ReasoningRequest, model_markers
from generation_service.assistant.tools import Tool, ToolChoice
from generation_service.assistant.turn import AssistantTurn
from generation_service.engine.errors import InvalidRequestError, LimitExceededError
from generation_service.proto_enums import enum_name
from structgen.json_limits import JsonDepthError, loads_limited
from structgen.schema_validation import ValidationResult
from structgen.v1 import generation_pb2 as pb

_CHOICES = {pb.TOOL_CHOICE_MODE_NONE: "none", pb.TOOL_CHOICE_MODE_AUTO: "auto",
            pb.TOOL_CHOICE_MODE_REQUIRED: "required", pb.TOOL_CHOICE_MODE_NAMED: "named"}
_REASONING = {pb.REASONING_MODE_UNSPECIFIED: "default", pb.REASONING_MODE_ENABLED: "enabled",
              pb.REASONING_MODE_DISABLED: "disabled"}


def tools(request) -> tuple[Tool, ...]:
    """GenerateRequest / TokenizeRequest `tools` as domain tools."""
    result = []
    for index, tool in enumerate(request.tools):
        parameters = None
        if tool.parameters:
            try:
                parameters = loads_limited(tool.parameters, f"tools[{index}].parameters")
            except JsonDepthError as error:
                raise LimitExceededError(str(error)) from None
            except ValueError as error:
                raise InvalidRequestError(str(error)) from None
        try:
            result.append(Tool(tool.name, tool.description, parameters))
        except ValueError as error:
            raise InvalidRequestError(f"tools[{index}]: {error}") from None
    return tuple(result)


def tool_choice(request: pb.GenerateRequest) -> ToolChoice | None:
    """None: unset (AUTO with tools)."""
    choice = request.tool_choice
    if choice.mode == pb.TOOL_CHOICE_MODE_UNSPECIFIED and not choice.name:
        return None
    mode = enum_name(_CHOICES, choice.mode, "tool_choice.mode") if choice.mode else "named"
    try:
        return ToolChoice(mode, choice.name)
    except ValueError as error:
        raise InvalidRequestError(f"tool_choice: {error}") from None


def reasoning(request) -> ReasoningRequest | None:
    if not request.HasField("reasoning"):
        return None
    options = request.reasoning
    try:
        return ReasoningRequest(mode=enum_name(_REASONING, options.mode, "reasoning.mode"),
                                max_tokens=options.max_tokens if options.HasField("max_tokens") else None,
                                begin=options.begin_marker, end=options.end_marker)
    except ValueError as error:
        raise InvalidRequestError(f"reasoning: {error}") from None


def template_kwargs(request) -> dict | None:
    """Template variables of the request's reasoning mode (enable_thinking)."""
    options = reasoning(request)
    flag = None if options is None else options.enable_thinking
    return None if flag is None else {"enable_thinking": flag}


def chat_entry(message: pb.ChatMessage) -> dict:
    """One turn as chat templates read it; a call's arguments as an object (templates write
    `arguments | tojson`)."""
    entry: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        entry["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.name, "arguments": _arguments(call.arguments)}} for call in message.tool_calls]
    if message.tool_call_id:
        entry["tool_call_id"] = message.tool_call_id
    if message.name:
        entry["name"] = message.name
    return entry


def _arguments(text: str):
    try:
        return loads_limited(text, "tool_calls.arguments")
    except ValueError:  # (JsonDepthError too) templates that write the string as it is get it
        return text


def add_piece(response: pb.GenerateResponse, piece: TurnPiece, turn: AssistantTurn,
              validation_to_proto) -> list[ValidationResult]:
    """The turn's share of one response: content in `text`, reasoning apart, parsed calls; the
    calls' validations."""
    response.text = piece.content
    response.reasoning_text = piece.reasoning
    response.incomplete_tool_call = piece.incomplete_call
    validations = [turn.validate(call) for call in piece.calls]
    for call, validation in zip(piece.calls, validations):
        response.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments,
                                validation=validation_to_proto(validation))
    return validations


def model_info(tokenizer) -> dict:
    """GetModelInfoResponse's tool-call format and reasoning markers of the served model."""
    if tokenizer is None or not tokenizer.chat_template:
        return {}
    markers = model_markers(tokenizer)
    info = {"tool_call_format": detect_format(tokenizer.chat_template)}
    if markers is not None:
        info.update(reasoning_begin=markers.begin, reasoning_end=markers.end)
    return info
