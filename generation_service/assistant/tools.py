"""Tools a model may call, the choice among them, and the calls it made.

Domain types both API fronts convert into: `Tool` (name, description, JSON Schema of the
arguments), `ToolChoice` (none / auto / required / named) and `ToolCall` (id, name, arguments
as JSON text). `validate_call` checks a call's arguments against its tool's full schema, as
the final validation of a json_schema output does.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Literal, Mapping

from structgen.schema_validation import ValidationIssue, ValidationResult, validate_output

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
ANY_OBJECT = {"type": "object"}
ToolChoiceMode = Literal["none", "auto", "required", "named"]
TOOL_CHOICE_MODES = ("none", "auto", "required", "named")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict | None = None  # JSON Schema of the arguments; None: any JSON object

    def __post_init__(self) -> None:
        if not TOOL_NAME.fullmatch(self.name):
            raise ValueError(f"tool name {self.name!r} must be 1 to 64 of A-Z a-z 0-9 _ . -")
        if self.parameters is not None and not isinstance(self.parameters, dict):
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON Schema object")

    @property
    def schema(self) -> dict:
        return self.parameters if self.parameters is not None else ANY_OBJECT

    def template_entry(self) -> dict:
        """The tool as chat templates read it (OpenAI's function-tool shape)."""
        function: dict = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode = "auto"
    name: str = ""  # the tool to call, with mode "named"

    def __post_init__(self) -> None:
        if self.mode not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool_choice must be one of {TOOL_CHOICE_MODES}, got {self.mode!r}")
        if (self.mode == "named") != bool(self.name):
            raise ValueError("tool_choice names a tool exactly when its mode is named")

    @property
    def forces_calls(self) -> bool:
        """The output is calls only."""
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def check_tools(tools: tuple[Tool, ...], choice: ToolChoice) -> None:
    """Raises ValueError for duplicate names or a choice no tool satisfies."""
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: names must be unique, got {names}")
    if not tools and choice.mode in ("required", "named"):
        raise ValueError(f"tool_choice {choice.mode} needs tools")
    if choice.mode == "named" and choice.name not in names:
        raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools {names}")


def validate_call(call: ToolCall, tools: Mapping[str, Tool]) -> ValidationResult:
    """The call's arguments against its tool's full `parameters` schema."""
    tool = tools.get(call.name)
    if tool is None:
        issue = ValidationIssue("", f"{call.name!r} is not one of the request's tools", "")
        return ValidationResult(False, (issue,), 1)
    return validate_output(json.dumps(tool.schema), call.arguments)
