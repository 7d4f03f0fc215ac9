"""proto <-> domain for the public API (structgen.v1). No grpc calls, no torch.

`to_generation_request` raises ValueError / EngineError subclasses; the error interceptor
turns them into INVALID_ARGUMENT / OUT_OF_RANGE with the message unchanged.
"""
from __future__ import annotations

import time
import uuid

from generation_service import proto_turn
from generation_service.assistant.turn import AssistantTurn, plan_turn
from generation_service.config import ServeConfig
from generation_service.engine.errors import InvalidRequestError, LimitExceededError
from generation_service.engine.events import FinishReason, OutputEvent
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from generation_service.proto_enums import enum_name
from grammar_contract.report import GuaranteeReport
from grammar_contract.spec import GrammarSpec, json_layout
from structgen.json_limits import JsonDepthError, loads_limited
from structgen.schema_validation import ValidationResult
from structgen.v1 import generation_pb2 as pb

_BACKENDS = {pb.GRAMMAR_BACKEND_UNSPECIFIED: "auto", pb.GRAMMAR_BACKEND_XGRAMMAR: "xgrammar",
             pb.GRAMMAR_BACKEND_LLGUIDANCE: "llguidance"}
_PROPOSERS = {pb.DRAFT_PROPOSER_UNSPECIFIED: "ngram", pb.DRAFT_PROPOSER_NGRAM: "ngram",
              pb.DRAFT_PROPOSER_GRAMMAR: "grammar", pb.DRAFT_PROPOSER_SELF: "self"}
_FINISH = {FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
           FinishReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
           FinishReason.MAX_TOKENS: pb.FINISH_REASON_MAX_TOKENS,
           FinishReason.GRAMMAR_COMPLETE: pb.FINISH_REASON_GRAMMAR_COMPLETE,
           FinishReason.BUDGET_CLOSED: pb.FINISH_REASON_BUDGET_CLOSED}


# the roles chat templates know (OpenAI's; "developer" is its newer "system")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_to_dicts(chat: pb.ChatMessages) -> list[dict]:
    if not chat.messages:
        raise InvalidRequestError("chat needs at least one message")
    for index, message in enumerate(chat.messages):
        if not message.role:
            raise InvalidRequestError(f"chat.messages[{index}].role is empty")
        if message.role not in CHAT_ROLES:
            raise InvalidRequestError(f"chat.messages[{index}].role must be one of {', '.join(CHAT_ROLES)}; "
                                      f"got {message.role!r}")
    return [proto_turn.chat_entry(m) for m in chat.messages]


def prompt_ids(request, tokenizer) -> tuple[int, ...]:
    """Token ids of a GenerateRequest's or TokenizeRequest's `input` oneof (a chat with its
    tools and reasoning mode rendered by the chat template)."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("no input: set one of prompt, token_ids or chat")
    if request.tools and kind != "chat":
        raise InvalidRequestError("tools need chat input (the chat template shows them to the model)")
    if kind in ("prompt", "text"):
        return tuple(tokenizer.encode(getattr(request, kind)))
    if kind == "chat":
        tools = kwargs = None
        if request.tools or request.HasField("reasoning"):
            tools = [tool.template_entry() for tool in proto_turn.tools(request)] or None
            kwargs = proto_turn.template_kwargs(request)
        return tuple(_render_chat(tokenizer, chat_to_dicts(request.chat), tools, kwargs))
    ids = tuple(request.token_ids.ids)
    vocab_size = tokenizer.vocab_size
    bad = [i for i in ids if i >= vocab_size]
    if bad:
        raise InvalidRequestError(f"token_ids: id {bad[0]} is not below the vocabulary size {vocab_size}")
    return ids


def _render_chat(tokenizer, messages: list[dict], tools=None, template_kwargs=None) -> list[int]:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, template_kwargs=template_kwargs)
    except ValueError:
        raise
    except Exception as error:  # jinja2 TemplateError: the template refused these messages
        if type(error).__module__.startswith("jinja2"):
            raise InvalidRequestError(f"chat: the model's chat template refused the messages: {error}") from None
        raise


def grammar_spec(request: pb.GenerateRequest, config: ServeConfig) -> GrammarSpec | None:
    kind = request.WhichOneof("constraint")
    if kind is None:
        return None
    options = request.constraint_options
    text, choices = "", ()
    if kind == "choice":
        choices = tuple(request.choice.choices)
        size = sum(len(c.encode()) for c in choices)
    elif kind != "json_object":
        text = getattr(request, kind)
        size = len(text.encode())
    else:
        size = 0
    if size > config.max_grammar_bytes:
        raise LimitExceededError(f"{kind} constraint is {size} bytes; the limit max_grammar_bytes is "
                                 f"{config.max_grammar_bytes}")
    if kind == "json_schema":
        _check_json(text, "json_schema")
    if kind == "structural_tag":
        _check_json(text, "structural_tag")
    try:
        layout = json_layout(compact=options.compact, any_whitespace=options.any_whitespace,
                             max_whitespace=options.max_whitespace if options.HasField("max_whitespace") else None)
    except ValueError as error:
        raise InvalidRequestError(f"constraint_options: {error}") from None
    return GrammarSpec(kind=kind, text=text, choices=choices, **layout, strict=options.strict,
                       backend=enum_name(_BACKENDS, options.backend, "constraint_options.backend"))


def _check_json(text: str, field: str) -> None:
    try:
        loads_limited(text, field)
    except JsonDepthError as error:
        raise LimitExceededError(str(error)) from None
    except ValueError as error:
        raise InvalidRequestError(str(error)) from None


def sampling_params(request: pb.GenerateRequest, config: ServeConfig, tokenizer=None) -> SamplingParams:
    sampling, stop = request.sampling, request.stop

    def given(name: str, default):
        return getattr(sampling, name) if sampling.HasField(name) else default

    vocab_size = getattr(tokenizer, "vocab_size", None)
    top_k = given("top_k", config.default_top_k)
    if vocab_size is not None and top_k > vocab_size:
        raise InvalidRequestError(f"sampling.top_k {top_k} exceeds the vocabulary size {vocab_size}; 0 disables top-k")
    bad_stop = [t for t in stop.stop_token_ids if vocab_size is not None and t >= vocab_size]
    if bad_stop:
        raise InvalidRequestError(f"stop.stop_token_ids: id {bad_stop[0]} is not below the vocabulary size {vocab_size}")

    bad_bias = [t for t in sampling.logit_bias if vocab_size is not None and t >= vocab_size]
    if bad_bias:
        raise InvalidRequestError(f"sampling.logit_bias: token id {min(bad_bias)} is not below the vocabulary "
                                  f"size {vocab_size}")
    max_new_tokens = stop.max_tokens or config.default_max_tokens
    min_tokens = given("min_tokens", 0)
    if min_tokens > max_new_tokens:
        raise InvalidRequestError(f"sampling.min_tokens {min_tokens} exceeds the max_tokens in effect "
                                  f"({max_new_tokens}); raise stop.max_tokens or lower min_tokens")
    try:
        return SamplingParams(
            temperature=given("temperature", config.default_temperature),
            top_k=top_k, top_p=given("top_p", config.default_top_p),
            seed=given("seed", None), max_new_tokens=max_new_tokens,
            stop_token_ids=tuple(stop.stop_token_ids), stop_strings=tuple(stop.stop_strings),
            ignore_eos=stop.ignore_eos, num_logprobs=request.num_logprobs,
            frequency_penalty=given("frequency_penalty", 0.0), presence_penalty=given("presence_penalty", 0.0),
            repetition_penalty=given("repetition_penalty", 1.0), min_p=given("min_p", 0.0),
            logit_bias=tuple(sorted(sampling.logit_bias.items())), min_tokens=min_tokens)
    except ValueError as error:  # the domain's range checks, named as the proto's fields
        raise InvalidRequestError(f"sampling.{error}" if _names_sampling_field(str(error)) else str(error)) from None


_SAMPLING_FIELDS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "logit_bias",
                    "min_tokens", "temperature", "top_p", "top_k")


def _names_sampling_field(message: str) -> bool:
    return message.startswith(_SAMPLING_FIELDS)


def to_generation_request(request: pb.GenerateRequest, tokenizer, config: ServeConfig,
                          time_remaining: float | None) -> GenerationRequest:
    """The domain request; `time_remaining` is the call's deadline in seconds from now."""
    return convert_generate(request, tokenizer, config, time_remaining)[0]


def convert_generate(request: pb.GenerateRequest, tokenizer, config: ServeConfig,
                     time_remaining: float | None) -> tuple[GenerationRequest, AssistantTurn | None]:
    """The domain request and its assistant turn (reasoning span, tools; None without either)."""
    deadline = None if time_remaining is None else time.monotonic() + time_remaining
    speculative = request.speculative
    ids = prompt_ids(request, tokenizer)
    grammar = grammar_spec(request, config)
    turn = _turn(request, tokenizer, ids)
    if turn is not None:
        grammar = _turn_grammar(turn, grammar, request, config)
    return GenerationRequest(
        request_id=request.request_id or uuid.uuid4().hex[:16],
        prompt_ids=ids,
        sampling=sampling_params(request, config, tokenizer),
        grammar=grammar,
        speculative=SpeculativeParams(num_draft_tokens=speculative.num_draft_tokens,
                                      proposer=enum_name(_PROPOSERS, speculative.proposer, "speculative.proposer")),
        deadline=deadline, skip_special_tokens=turn is None or turn.skip_special_tokens), turn


def _turn(request: pb.GenerateRequest, tokenizer, ids: tuple[int, ...]) -> AssistantTurn | None:
    if not request.tools and not request.HasField("reasoning") and not request.HasField("tool_choice"):
        return None  # (the path of every request that uses neither)
    try:
        return plan_turn(tokenizer, ids, tools=proto_turn.tools(request), choice=proto_turn.tool_choice(request),
                         single_call=request.single_tool_call, reasoning=proto_turn.reasoning(request))
    except ValueError as error:
        raise InvalidRequestError(str(error)) from None


def _turn_grammar(turn: AssistantTurn, constraint: GrammarSpec | None, request: pb.GenerateRequest,
                  config: ServeConfig) -> GrammarSpec | None:
    options = request.constraint_options
    if turn.uses_tools and (options.compact or (options.HasField("max_whitespace") and options.max_whitespace == 0)):
        raise InvalidRequestError("constraint_options.compact and max_whitespace 0 do not apply to tool-call "
                                  "arguments; use max_whitespace >= 1")
    try:
        grammar = turn.grammar(constraint, backend=enum_name(_BACKENDS, options.backend, "constraint_options.backend"),
                               max_whitespace=options.max_whitespace if options.HasField("max_whitespace") else None,
                               any_whitespace=options.any_whitespace)
    except ValueError as error:
        raise InvalidRequestError(str(error)) from None
    if grammar is not None and turn.uses_tools and len(grammar.text.encode()) > config.max_grammar_bytes:
        raise LimitExceededError(f"the tools' grammar is {len(grammar.text.encode())} bytes; the limit "
                                 f"max_grammar_bytes is {config.max_grammar_bytes}")
    return grammar


def guarantee_to_proto(report: GuaranteeReport) -> pb.GuaranteeReport:
    return pb.GuaranteeReport(
        backend=report.backend, compile_ms=report.compile_ms, cache_hit=report.cache_hit,
        unenforced=[pb.UnenforcedSchemaKeyword(keyword=k.keyword, pointer=k.pointer, reason=k.reason)
                    for k in report.unenforced],
        restricted=[pb.UnenforcedSchemaKeyword(keyword=k.keyword, pointer=k.pointer, reason=k.reason)
                    for k in report.restricted], fallback_from=report.fallback_from)


def validation_to_proto(result: "ValidationResult | None") -> pb.ValidationResult:
    """The final validation; `None` (not run) is never reported as valid.

    Issues are structgen.schema_validation's ("<json pointer>", "<message> (schema <pointer>)");
    an issue at schema pointer "schema" means jsonschema could not use the schema: NOT_RUN.
    """
    if result is None:
        return pb.ValidationResult(valid=False, status=pb.VALIDATION_STATUS_NOT_RUN, errors=[
            pb.ValidationError(path="", message="the output was not validated")])
    not_run = any(issue.schema_pointer == "schema" for issue in result.issues)
    status = (pb.VALIDATION_STATUS_NOT_RUN if not_run else
              pb.VALIDATION_STATUS_VALID if result.valid else pb.VALIDATION_STATUS_INVALID)
    message = pb.ValidationResult(valid=status == pb.VALIDATION_STATUS_VALID, status=status,
                                  num_errors=result.num_errors, truncated=result.truncated)
    for error in result.errors:
        path, sep, text = error.partition(": ")
        if not sep or not (path == "" or path.startswith("/")):
            path, text = "", error
        message.errors.add(path=path, message=text)
    return message


def event_to_proto(event: OutputEvent, request: GenerationRequest,
                   validation: "ValidationResult | None" = None) -> pb.GenerateResponse:
    """`validation`: the final output checked against the full schema (server.Generate runs
    it on the final event of a json_schema request); None there reports NOT_RUN."""
    response = pb.GenerateResponse(request_id=request.request_id, token_ids=event.token_ids,
                                   text=event.text)
    for logprob in event.logprobs:
        response.logprobs.add(token_id=logprob.token_id, logprob=logprob.logprob,
                              top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprob.top])
    if event.guarantee is not None:
        response.guarantee.CopyFrom(guarantee_to_proto(event.guarantee))
    if event.finish_reason is not None:
        response.finish_reason = _FINISH.get(event.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
    if event.usage is not None:
        usage = event.usage
        response.usage.CopyFrom(pb.Usage(
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            draft_tokens_proposed=usage.draft_tokens_proposed,
            draft_tokens_accepted=usage.draft_tokens_accepted, cached_prompt_tokens=usage.cached_prompt_tokens,
            forced_tokens=usage.forced_tokens, grammar_rejected_draft_tokens=usage.grammar_rejected_draft_tokens))
    if event.is_final and request.grammar is not None and request.grammar.kind == "json_schema":
        response.validation.CopyFrom(validation_to_proto(validation))
    return response
