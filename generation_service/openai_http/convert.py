"""OpenAI request bodies -> the engine's domain requests (engine/params.py), one per choice.

Pure functions over the validated bodies of schemas.py, the engine's tokenizer and limits,
and ServeConfig's request defaults (the same defaults the gRPC port applies to unset
fields). Raises InvalidRequestError / LimitExceededError / ApiError with the parameter named.
"""
from __future__ import annotations

import json
import uuid

from generation_service.assistant.turn import AssistantTurn
from generation_service.config import ServeConfig
from generation_service.engine.errors import InvalidRequestError, LimitExceededError
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from generation_service.openai_http import tools
from generation_service.openai_http.errors import ApiError
from generation_service.openai_http.schemas import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                                                    MAX_STOP_STRINGS, SamplingBody)
from grammar_contract.spec import GrammarSpec, json_layout

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def check_model(body: SamplingBody, model_name: str, served_as: str = "") -> None:
    """`model` is the served model's name (/v1/models) or the --model value it was served
    with (`default`, a path)."""
    if body.model not in (model_name, served_as):
        raise ApiError(404, f"The model {body.model!r} does not exist; this server serves {model_name!r}",
                       "invalid_request_error", "model", "model_not_found")


def refuse_unsupported(body: SamplingBody) -> None:
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise ApiError(400, "echo is not supported: the response carries the completion only", param="echo")
        if body.best_of not in (None, 1):
            raise ApiError(400, "best_of is not supported; use n", param="best_of")
        if body.suffix is not None:
            raise ApiError(400, "suffix (fill in the middle) is not supported", param="suffix")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


def _max_new_tokens(body: SamplingBody, limit: int, default: int) -> int:
    value = body.max_new_tokens
    if value is None:
        return min(default, limit)
    if value > limit:
        name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise LimitExceededError(f"{name} {value} exceeds the server's max_new_tokens_limit {limit}")
    return value


def sampling_params(body: SamplingBody, config: ServeConfig, limit: int, index: int) -> SamplingParams:
    """The engine's sampling of choice `index`: a given seed becomes seed + index, so the
    choices of one seeded request differ and each is reproducible."""
    stops = body.stop_strings
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    top_k = body.top_k if body.top_k is not None else config.default_top_k
    max_new_tokens = _max_new_tokens(body, limit, config.default_max_tokens)
    min_tokens = body.min_tokens or 0
    if min_tokens > max_new_tokens:
        raise ApiError(400, f"min_tokens {min_tokens} exceeds the max_tokens in effect ({max_new_tokens}); "
                            "raise max_tokens or lower min_tokens", param="min_tokens", code="invalid_value")
    return SamplingParams(
        temperature=body.temperature if body.temperature is not None else config.default_temperature,
        top_p=body.top_p if body.top_p is not None else config.default_top_p,
        top_k=max(top_k, 0), seed=None if body.seed is None else body.seed + index,
        max_new_tokens=max_new_tokens,
        stop_strings=stops, ignore_eos=body.structgen.ignore_eos, num_logprobs=body.num_logprobs,
        frequency_penalty=_given(body.frequency_penalty, 0.0), presence_penalty=_given(body.presence_penalty, 0.0),
        repetition_penalty=_given(body.repetition_penalty, 1.0), min_p=_given(body.min_p, 0.0),
        logit_bias=logit_bias(body.logit_bias), min_tokens=min_tokens)


def _given(value, neutral):
    return neutral if value is None else value


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (JSON keys are strings) -> sorted (id, bias) pairs."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias: key {key!r} is not a token id (an integer as a string)",
                           param="logit_bias", code="invalid_value") from None
        if token < 0 or not -100.0 <= value <= 100.0:
            raise ApiError(400, f"logit_bias: {key!r}: {value} must map a token id >= 0 to a bias in [-100, 100]",
                           param="logit_bias", code="invalid_value")
        pairs.append((token, float(value)))
    if len({token for token, _ in pairs}) != len(pairs):
        raise ApiError(400, "logit_bias names a token id twice", param="logit_bias", code="invalid_value")
    return tuple(sorted(pairs))


def grammar_spec(body: SamplingBody, config: ServeConfig, turn: AssistantTurn | None = None) -> GrammarSpec | None:
    """response_format, or the tool-call grammar of a chat request with tools; after the turn's
    reasoning span when it has one."""
    response_format = body.response_format
    kind, text = None, ""
    strict = False
    if response_format is not None and response_format.type == "json_object":
        kind = "json_object"
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise ApiError(400, "response_format json_schema needs its json_schema object",
                           param="response_format.json_schema")
        kind, text = "json_schema", json.dumps(response_format.json_schema.json_schema)
        strict = bool(response_format.json_schema.strict)
    options = body.structgen
    constraint = None
    if kind is not None:
        _check_size(kind, text, config)
        try:
            layout = json_layout(compact=options.compact, any_whitespace=options.any_whitespace,
                                 max_whitespace=options.max_whitespace)
        except ValueError as error:
            raise ApiError(400, f"structgen: {error}", param="structgen") from None
        constraint = GrammarSpec(kind=kind, text=text, **layout, strict=strict, backend=options.backend)
    if turn is None:
        return constraint
    if turn.uses_tools:
        if constraint is not None:
            raise ApiError(400, "response_format together with tools is not supported yet: use "
                                "tool_choice 'none' for a constrained reply, or drop response_format",
                           param="response_format")
        if options.compact:
            raise InvalidRequestError("structgen.compact does not apply to tool-call arguments; "
                                      "use structgen.max_whitespace (>= 1)")
        if options.max_whitespace == 0:
            raise InvalidRequestError("structgen.max_whitespace must be >= 1 with tools")
    spec = turn.grammar(constraint, max_whitespace=options.max_whitespace, any_whitespace=options.any_whitespace,
                        backend=options.backend)
    if spec is not None and turn.uses_tools:
        _check_size("tools", spec.text, config)
    return spec


def _check_size(kind: str, text: str, config: ServeConfig) -> None:
    if len(text.encode()) > config.max_grammar_bytes:
        raise LimitExceededError(f"the {kind} constraint is {len(text.encode())} bytes; the limit "
                                 f"max_grammar_bytes is {config.max_grammar_bytes}")


def _speculative(body: SamplingBody) -> SpeculativeParams:
    return SpeculativeParams(num_draft_tokens=body.structgen.num_draft_tokens,
                             proposer=body.structgen.draft_proposer)


def _requests(body: SamplingBody, prompts: list[tuple[int, ...]], response_id: str, engine,
              config: ServeConfig, turn: AssistantTurn | None = None) -> list[GenerationRequest]:
    """prompts x n requests, choice index = prompt index * n + j (OpenAI's order)."""
    grammar = grammar_spec(body, config, turn)
    limit = engine.config.max_new_tokens_limit
    skip_special_tokens = turn is None or turn.skip_special_tokens
    return [GenerationRequest(request_id=f"{response_id}-{p * body.n + j}", prompt_ids=prompt_ids,
                              sampling=sampling_params(body, config, limit, p * body.n + j),
                              grammar=grammar, speculative=_speculative(body), skip_special_tokens=skip_special_tokens)
            for p, prompt_ids in enumerate(prompts) for j in range(body.n)]


def chat_requests(body: ChatCompletionRequest, response_id: str, engine,
                  config: ServeConfig) -> tuple[list[GenerationRequest], AssistantTurn | None]:
    """One request per choice and the turn they share (None without tools and reasoning)."""
    prompt = render_chat(body, engine.tokenizer)
    turn = tools.chat_turn(body, engine.tokenizer, prompt)
    return _requests(body, [prompt], response_id, engine, config, turn), turn


def completion_requests(body: CompletionRequest, response_id: str, engine, config: ServeConfig):
    if body.structgen.reasoning is not None:
        raise ApiError(400, "structgen.reasoning applies to chat completions only", param="structgen.reasoning")
    prompts = []
    for index, prompt in enumerate(body.prompts):
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer; this model has none: send token ids")
            prompts.append(tuple(engine.tokenizer.encode(prompt)))
        else:
            prompts.append(tuple(prompt))
    if not prompts:
        raise ApiError(400, "prompt is empty", param="prompt")
    return _requests(body, prompts, response_id, engine, config)


def render_chat(body: ChatCompletionRequest, tokenizer) -> tuple[int, ...]:
    if tokenizer is None:
        raise InvalidRequestError("chat needs the model's tokenizer and chat template; this model has none")
    messages = [_message(message, index) for index, message in enumerate(body.messages)]
    try:
        return tuple(tokenizer.apply_chat_template(messages, tools=tools.template_tools(body),
                                                   template_kwargs=_template_kwargs(body)))
    except ValueError as error:
        raise InvalidRequestError(f"messages: {error}") from None
    except Exception as error:  # jinja2's TemplateError: the template refused these messages
        if type(error).__module__.startswith("jinja2"):
            raise ApiError(400, f"messages: the model's chat template refused them: {error}",
                           param="messages") from None
        raise


_RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                      "unk_token", "pad_token"})


def _template_kwargs(body: ChatCompletionRequest) -> dict | None:
    kwargs = tools.template_kwargs(body)
    reserved = sorted(_RESERVED_TEMPLATE_NAMES.intersection(kwargs or {}))
    if reserved:
        raise ApiError(400, f"chat_template_kwargs must not set {', '.join(reserved)} (the server sets them)",
                       param="chat_template_kwargs")
    return kwargs


def _message(message: ChatMessage, index: int) -> dict:
    """One message as chat templates read it: developer is system, content is one string."""
    entry: dict = {"role": "system" if message.role == "developer" else message.role,
                   "content": _text(message, index)}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
            for call in message.tool_calls]
    return entry


def _text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part_index, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"messages[{index}].content[{part_index}]: content of type {part.type!r} is "
                                "not supported (this model reads text only)",
                           param=f"messages.{index}.content.{part_index}.type")
        texts.append(part.text)
    return "".join(texts)


def _arguments(text: str):
    """Templates write `arguments | tojson` or the string as it is: give them the object."""
    try:
        return json.loads(text)
    except ValueError:
        return text
