"""Request body of `POST /v1/responses` (OpenAI's Responses API), as pydantic models.

Unknown fields are refused by name, as on the other routes. Parameters a stateless server may
ignore (`store`, `metadata`, `service_tier`, `user`, `truncation`, `include`, ...) are
accepted and change nothing; those it cannot honour (`previous_response_id`, `background`,
`reasoning`, hosted tools) are refused with the reason (convert.py).
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import ConfigDict, Field

from generation_service.openai_http.schemas import Body, JsonSchemaFormat, StructgenOptions


class InputText(Body):
    type: Literal["input_text", "output_text", "text"]
    text: str
    model_config = ConfigDict(extra="allow")  # annotations, logprobs of an output_text sent back


class InputMessage(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputText]]
    id: str | None = None
    status: str | None = None


class CallItem(Body):
    """An item of an earlier turn about one call, sent back with the conversation."""

    call_id: str
    id: str | None = None
    status: str | None = None


class FunctionCallItem(CallItem):
    type: Literal["function_call"]
    name: str
    arguments: str


class FunctionCallOutputItem(CallItem):
    type: Literal["function_call_output"]
    output: str


InputItem = Union[InputMessage, FunctionCallItem, FunctionCallOutputItem]


class FunctionTool(Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    """text.format: "text", "json_object", or "json_schema" with name, schema and strict inline."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def as_json_schema_format(self) -> JsonSchemaFormat:
        return JsonSchemaFormat(name=self.name or "response", description=self.description,
                                json_schema=True if self.json_schema is None else self.json_schema, strict=self.strict)


class TextOptions(Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; a model without the setting ignores it


class ResponsesRequest(Body):
    model: str
    input: Union[str, list[InputItem]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = None
    stream: bool = False
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
    parallel_tool_calls: bool = True
    structgen: StructgenOptions = Field(default_factory=StructgenOptions)
    # accepted, and change nothing here (a stateless server; docs/operations.md lists them)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    # refused unless neutral (convert.py)
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
