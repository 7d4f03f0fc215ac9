"""Builds GenerateRequest protos from keyword arguments and turns responses into dataclasses."""
from __future__ import annotations

import json
from typing import Any, Sequence

from structgen.v1 import generation_pb2 as pb

from structgen_client.types import (Chunk, EngineStats, Guarantee, ModelInfo, TokenLogprob, ToolCall,
                                    UnenforcedKeyword, Usage, Validation)

_FINISH = {pb.FINISH_REASON_STOP_TOKEN: "stop_token", pb.FINISH_REASON_STOP_STRING: "stop_string",
           pb.FINISH_REASON_MAX_TOKENS: "max_tokens",
           pb.FINISH_REASON_GRAMMAR_COMPLETE: "grammar_complete",
           pb.FINISH_REASON_BUDGET_CLOSED: "budget_closed"}
_BACKENDS = {None: pb.GRAMMAR_BACKEND_UNSPECIFIED, "auto": pb.GRAMMAR_BACKEND_UNSPECIFIED,
             "xgrammar": pb.GRAMMAR_BACKEND_XGRAMMAR, "llguidance": pb.GRAMMAR_BACKEND_LLGUIDANCE}
_PROPOSERS = {None: pb.DRAFT_PROPOSER_UNSPECIFIED, "ngram": pb.DRAFT_PROPOSER_NGRAM,
              "grammar": pb.DRAFT_PROPOSER_GRAMMAR, "self": pb.DRAFT_PROPOSER_SELF}


_VALIDATION_STATUS = {pb.VALIDATION_STATUS_VALID: "valid", pb.VALIDATION_STATUS_INVALID: "invalid",
                      pb.VALIDATION_STATUS_NOT_RUN: "not_run"}


def _json_text(value: str | dict | None) -> str | None:
    return value if value is None or isinstance(value, str) else json.dumps(value)


def _call(call: dict) -> pb.ToolCall:
    """A call of an earlier assistant turn: {"id", "name", "arguments"} or OpenAI's shape."""
    function = call.get("function", call)
    return pb.ToolCall(id=call.get("id", ""), name=function["name"],
                       arguments=_json_text(function.get("arguments", {})))


def _message(m: dict) -> pb.ChatMessage:
    return pb.ChatMessage(role=m["role"], content=m.get("content") or "",
                          tool_calls=[_call(c) for c in m.get("tool_calls") or []],
                          tool_call_id=m.get("tool_call_id", ""), name=m.get("name", ""))


def _chat(messages: Sequence[dict]) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[_message(m) for m in messages])


def _tool(tool: dict) -> pb.Tool:
    """{"name", "description", "parameters"} or OpenAI's {"type": "function", "function": {...}}."""
    function = tool.get("function", tool)
    parameters = function.get("parameters")
    return pb.Tool(name=function["name"], description=function.get("description", ""),
                   parameters=_json_text(parameters) if parameters is not None else "")


_TOOL_CHOICES = {"none": pb.TOOL_CHOICE_MODE_NONE, "auto": pb.TOOL_CHOICE_MODE_AUTO,
                 "required": pb.TOOL_CHOICE_MODE_REQUIRED}


def _tool_choice(choice: str | dict) -> pb.ToolChoice:
    """"none" / "auto" / "required", a tool's name, or {"name": ...} (OpenAI's {"function": {...}} too)."""
    if isinstance(choice, dict):
        return pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NAMED, name=choice.get("function", choice)["name"])
    if choice in _TOOL_CHOICES:
        return pb.ToolChoice(mode=_TOOL_CHOICES[choice])
    return pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NAMED, name=choice)


def _reasoning(reasoning: bool | None, max_tokens: int | None, markers: Sequence[str] | None):
    """None when nothing is asked; True: reasoning on (with a budget and markers), False: off."""
    if reasoning is None and max_tokens is None and not markers:
        return None
    options = pb.ReasoningOptions(mode=pb.REASONING_MODE_DISABLED if reasoning is False
                                  else pb.REASONING_MODE_ENABLED)
    if max_tokens is not None:
        options.max_tokens = max_tokens
    if markers:
        options.begin_marker, options.end_marker = markers
    return options


def _add_turn(request, tools, tool_choice, single_tool_call, reasoning, reasoning_max_tokens,
              reasoning_markers) -> None:
    request.tools.extend(_tool(t) for t in tools or ())
    if tool_choice is not None:
        request.tool_choice.CopyFrom(_tool_choice(tool_choice))
    if single_tool_call:
        request.single_tool_call = True
    options = _reasoning(reasoning, reasoning_max_tokens, reasoning_markers)
    if options is not None:
        request.reasoning.CopyFrom(options)


def build_request(prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                  messages: Sequence[dict] | None = None,
                  json_schema: str | dict | None = None, regex: str | None = None,
                  lark: str | None = None, structural_tag: str | dict | None = None,
                  json_object: bool = False, choices: Sequence[str] | None = None,
                  max_tokens: int = 0, temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None,
                  seed: int | None = None, frequency_penalty: float | None = None,
                  presence_penalty: float | None = None, repetition_penalty: float | None = None,
                  logit_bias: dict[int, float] | None = None, min_p: float | None = None,
                  min_tokens: int | None = None,
                  stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  ignore_eos: bool = False, compact: bool = False, max_whitespace: int | None = None,
                  any_whitespace: bool = False, strict: bool = False, backend: str | None = None, num_draft_tokens: int = 0,
                  proposer: str | None = None, num_logprobs: int = 0,
                  tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
                  single_tool_call: bool = False, reasoning: bool | None = None,
                  reasoning_max_tokens: int | None = None, reasoning_markers: Sequence[str] | None = None,
                  request_id: str = "") -> pb.GenerateRequest:
    """A GenerateRequest. Give exactly one of prompt / token_ids / messages, at most one constraint.

    Tools (chat only): each {"name", "description", "parameters" (a JSON Schema)} or OpenAI's
    function-tool shape; `tool_choice` "none" / "auto" / "required" or a tool's name;
    `single_tool_call` allows at most one. `reasoning` True lets the model reason first
    (`reasoning_max_tokens` caps it, `reasoning_markers` = (begin, end) when the model has
    none), False turns the template's reasoning off. JSON is single-line by default (", " and
    ": "); `compact` drops those spaces, `max_whitespace` N / `any_whitespace` let the model lay
    it out (runs of at most N whitespace characters / uncapped)."""
    inputs = [x for x in (prompt, token_ids, messages) if x is not None]
    if len(inputs) != 1:
        raise ValueError("give exactly one of prompt, token_ids, messages")
    request = pb.GenerateRequest(request_id=request_id, num_logprobs=num_logprobs)
    if prompt is not None:
        request.prompt = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        request.chat.CopyFrom(_chat(messages))
    constraints: dict[str, Any] = {
        "json_schema": _json_text(json_schema), "regex": regex, "lark": lark,
        "structural_tag": _json_text(structural_tag)}
    given = [k for k, v in constraints.items() if v is not None]
    given += ["json_object"] if json_object else []
    given += ["choice"] if choices is not None else []
    if len(given) > 1:
        raise ValueError(f"give at most one constraint, got {given}")
    for name, value in constraints.items():
        if value is not None:
            setattr(request, name, value)
    if json_object:
        request.json_object.SetInParent()
    if choices is not None:
        request.choice.choices.extend(choices)
    sampling = (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed),
                ("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty),
                ("repetition_penalty", repetition_penalty), ("min_p", min_p), ("min_tokens", min_tokens))
    for name, value in sampling:
        if value is not None:  # unset fields take the server's defaults
            setattr(request.sampling, name, value)
    for token_id, bias in (logit_bias or {}).items():
        request.sampling.logit_bias[int(token_id)] = bias
    request.stop.max_tokens = max_tokens
    request.stop.stop_strings.extend(stop)
    request.stop.stop_token_ids.extend(stop_token_ids)
    request.stop.ignore_eos = ignore_eos
    options = request.constraint_options
    options.compact, options.strict, options.backend = compact, strict, _BACKENDS[backend]
    options.any_whitespace = any_whitespace
    if max_whitespace is not None:
        options.max_whitespace = max_whitespace
    request.speculative.num_draft_tokens = num_draft_tokens
    request.speculative.proposer = _PROPOSERS[proposer]
    _add_turn(request, tools, tool_choice, single_tool_call, reasoning, reasoning_max_tokens, reasoning_markers)
    return request


def build_tokenize_request(text: str | None = None, messages: Sequence[dict] | None = None,
                           tools: Sequence[dict] | None = None, reasoning: bool | None = None):
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text, messages")
    if text is not None:
        request = pb.TokenizeRequest(text=text)
    else:
        request = pb.TokenizeRequest(chat=_chat(messages))
    request.tools.extend(_tool(t) for t in tools or ())
    options = _reasoning(reasoning, None, None)
    if options is not None:
        request.reasoning.CopyFrom(options)
    return request


def _validation(v: pb.ValidationResult) -> Validation:
    return Validation(v.valid, tuple((e.path, e.message) for e in v.errors),
                      _VALIDATION_STATUS.get(v.status, ""), v.num_errors, v.truncated)


def to_chunk(response: pb.GenerateResponse) -> Chunk:
    guarantee = None
    if response.HasField("guarantee"):
        g = response.guarantee
        guarantee = Guarantee(g.backend, tuple(UnenforcedKeyword(u.keyword, u.pointer, u.reason)
                                               for u in g.unenforced), g.compile_ms, g.cache_hit,
                              tuple(UnenforcedKeyword(u.keyword, u.pointer, u.reason) for u in g.restricted),
                              g.fallback_from)
    usage = None
    if response.HasField("usage"):
        u = response.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.draft_tokens_proposed,
                      u.draft_tokens_accepted, u.cached_prompt_tokens, u.forced_tokens, u.grammar_rejected_draft_tokens)
    validation = _validation(response.validation) if response.HasField("validation") else None
    return Chunk(text=response.text, token_ids=tuple(response.token_ids),
                 logprobs=tuple(TokenLogprob(lp.token_id, lp.logprob,
                                             tuple((t.token_id, t.logprob) for t in lp.top))
                                for lp in response.logprobs),
                 guarantee=guarantee, finish_reason=_FINISH.get(response.finish_reason),
                 usage=usage, validation=validation, request_id=response.request_id,
                 reasoning_text=response.reasoning_text,
                 tool_calls=tuple(ToolCall(c.id, c.name, c.arguments,
                                           _validation(c.validation) if c.HasField("validation") else None)
                                  for c in response.tool_calls),
                 incomplete_tool_call=response.incomplete_tool_call)


def to_model_info(r: pb.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(r.model_name, r.vocab_size, tuple(r.eos_token_ids), r.device, r.max_prompt_tokens,
                     r.max_new_tokens_limit, r.default_max_tokens, r.max_grammar_bytes,
                     r.max_message_bytes, r.max_batch, r.max_draft_tokens, tuple(r.constraint_kinds),
                     r.prefix_caching, r.tool_call_format, r.reasoning_begin, r.reasoning_end)


def to_engine_stats(r: pb.GetEngineStatsResponse) -> EngineStats:
    return EngineStats(r.num_waiting, r.num_running, r.num_kv_pages_used, r.num_slots_used,
                       r.num_grammar_matchers, r.grammar_available, r.num_kv_pages_total,
                       r.num_finished, r.num_tokens_generated, r.num_draft_tokens_proposed,
                       r.num_draft_tokens_accepted, r.num_kv_pages_cached, r.num_late_rows)
