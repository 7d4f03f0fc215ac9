"""Response bodies of the OpenAI-compatible API, as pydantic models.

Serialised with `dump` (exclude_unset): a field OpenAI always writes, even as null
(`finish_reason`, `logprobs`, a message's `content`), is set explicitly where the response is
built, constants (`object`, `type`) always; a field left unset (the `structgen` extension of
a free request) is left out.
The extension `structgen` on each choice carries what the gRPC API streams beside the
tokens: the guarantee report of a constrained request, the final JSON-Schema validation,
and the engine's own finish reason.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


class Model(BaseModel):
    def model_post_init(self, context: Any) -> None:
        # fields with a non-None default (object, type, role) are constants: always written
        self.model_fields_set.update(name for name, info in type(self).model_fields.items()
                                     if info.default is not None and info.default is not PydanticUndefined)

    def dump(self) -> dict:
        return self.model_dump(exclude_unset=True, mode="json")

    def dump_json(self) -> str:
        return self.model_dump_json(exclude_unset=True)


class PromptTokensDetails(Model):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(Model):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(Model):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Model):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(Model):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class FunctionCall(Model):
    name: str | None = None
    arguments: str | None = None


class ToolCall(Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(Model):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class Extension(Model):
    """What structgen adds to a choice (the gRPC API's GuaranteeReport / ValidationResult)."""

    token_ids: list[int] | None = None
    guarantee: dict[str, Any] | None = None
    validation: dict[str, Any] | None = None
    tool_call_validations: list[dict[str, Any]] | None = None
    incomplete_tool_call: str | None = None  # a call max_tokens cut short (never content)
    finish_reason: str | None = None


class ChatMessage(Model):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the reasoning span's text (vLLM's and DeepSeek's field)
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Model):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    structgen: Extension | None = None


class ChatCompletion(Model):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatDelta(Model):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Model):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    structgen: Extension | None = None


class ChatCompletionChunk(Model):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(Model):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    structgen: Extension | None = None


class Completion(Model):
    """Both the whole response and each streamed chunk (OpenAI uses one object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(Model):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "structgen"
    max_model_len: int | None = None


class ModelList(Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]
