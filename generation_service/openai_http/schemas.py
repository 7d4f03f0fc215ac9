"""Request bodies of the OpenAI-compatible API, as pydantic models.

Every model forbids unknown fields: a parameter this server does not know is a 400 naming it
(errors.py), never a silent ignore. Parameters the engine cannot apply yet are declared so
that their neutral value (what SDKs and frameworks send by default) is accepted, and
`convert.py` refuses any other value by name. Ranges the engine checks itself (top_p) are
left to `SamplingParams`, whose messages name the field; temperature takes OpenAI's [0, 2]
here (the engine allows more).
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 16      # n: one engine request per choice
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # SamplingParams.num_logprobs


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Body):
    """One part of a message's content; only text parts exist for a text model."""

    type: str
    text: str | None = None
    # image_url, input_audio, file, ...: named in the refusal (convert.py)
    model_config = ConfigDict(extra="allow")


class FunctionCall(Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None           # a tool turn: the call it answers
    refusal: str | None = None


class FunctionDefinition(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: any JSON object
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None  # True: our strict mode (refuse keywords the grammar cannot enforce)
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # an SDK default; there is nothing to obfuscate


class ReasoningOptions(Body):
    """structgen.reasoning: a free reasoning span before the answer (and its constraint)."""

    enabled: bool | None = None          # None: the chat template's default, no span
    max_tokens: int | None = Field(default=None, ge=0)  # budget; then the end marker is forced
    begin_marker: str | None = None      # the model's markers when unset
    end_marker: str | None = None


class StructgenOptions(Body):
    """Extension (`extra_body={"structgen": {...}}`): what the gRPC API offers beyond OpenAI's."""

    compact: bool = False                # JSON without free whitespace ("," and ":")
    max_whitespace: int | None = Field(default=None, ge=0)  # free whitespace, runs capped
    any_whitespace: bool = False         # free whitespace (default: single-line JSON)
    backend: Literal["auto", "xgrammar", "llguidance"] = "auto"
    ignore_eos: bool = False
    num_draft_tokens: int = Field(default=0, ge=0)
    draft_proposer: Literal["ngram", "grammar", "self"] = "ngram"
    return_token_ids: bool = False       # each choice's token ids in its structgen extension
    reasoning: ReasoningOptions | None = None  # chat only


class SamplingBody(Body):
    """The fields chat and text completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    seed: int | None = None
    stop: Union[str, list[str], None] = Field(default=None)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)  # OpenAI's range
    top_p: float | None = None
    user: str | None = None  # an end-user id for the caller's records; it changes no output
    # accepted and ignored, as by a server that stores nothing and has one tier
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    response_format: ResponseFormat | None = None
    structgen: StructgenOptions = Field(default_factory=StructgenOptions)
    # common extensions the engine has
    top_k: int | None = Field(default=None, ge=-1)  # -1 (vLLM's "off") or 0: off
    # logits processing (engine/logit_processing.py); ranges checked by SamplingParams
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def includes_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    # variables of the chat template (vLLM's name); enable_thinking also turns reasoning on or off
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int:
        """Top-n per token for the engine; the sampled token's own logprob needs n >= 1."""
        return max(1, self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(SamplingBody):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int:
        return 0 if self.logprobs is None else max(1, self.logprobs)

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per prompt: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)
