"""Builds GenerateRequest protos from keyword arguments and turns responses into dataclasses."""
from __future__ import annotations

import json
from typing import Any, Sequence

from structgen.v1 import generation_pb2 as pb

from structgen_client.types import (Chunk, EngineStats, Guarantee, ModelInfo, TokenLogprob,
                                    UnenforcedKeyword, Usage, Validation)

_FINISH = {pb.FINISH_REASON_STOP_TOKEN: "stop_token", pb.FINISH_REASON_STOP_STRING: "stop_string",
           pb.FINISH_REASON_MAX_TOKENS: "max_tokens",
           pb.FINISH_REASON_GRAMMAR_COMPLETE: "grammar_complete"}
_BACKENDS = {None: pb.GRAMMAR_BACKEND_UNSPECIFIED, "auto": pb.GRAMMAR_BACKEND_UNSPECIFIED,
             "xgrammar": pb.GRAMMAR_BACKEND_XGRAMMAR, "llguidance": pb.GRAMMAR_BACKEND_LLGUIDANCE}
_PROPOSERS = {None: pb.DRAFT_PROPOSER_UNSPECIFIED, "ngram": pb.DRAFT_PROPOSER_NGRAM,
              "grammar": pb.DRAFT_PROPOSER_GRAMMAR}


_VALIDATION_STATUS = {pb.VALIDATION_STATUS_VALID: "valid", pb.VALIDATION_STATUS_INVALID: "invalid",
                      pb.VALIDATION_STATUS_NOT_RUN: "not_run"}


def _json_text(value: str | dict | None) -> str | None:
    return value if value is None or isinstance(value, str) else json.dumps(value)


def _chat(messages: Sequence[dict]) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                                     for m in messages])


def build_request(prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                  messages: Sequence[dict] | None = None,
                  json_schema: str | dict | None = None, regex: str | None = None,
                  lark: str | None = None, structural_tag: str | dict | None = None,
                  json_object: bool = False, choices: Sequence[str] | None = None,
                  max_tokens: int = 0, temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None,
                  seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  ignore_eos: bool = False, compact: bool = False, max_whitespace: int | None = None,
                  strict: bool = False, backend: str | None = None, num_draft_tokens: int = 0,
                  proposer: str | None = None, num_logprobs: int = 0,
                  request_id: str = "") -> pb.GenerateRequest:
    """A GenerateRequest. Give exactly one of prompt / token_ids / messages, at most one constraint."""
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
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
        if value is not None:  # unset fields take the server's defaults
            setattr(request.sampling, name, value)
    request.stop.max_tokens = max_tokens
    request.stop.stop_strings.extend(stop)
    request.stop.stop_token_ids.extend(stop_token_ids)
    request.stop.ignore_eos = ignore_eos
    options = request.constraint_options
    options.compact, options.strict, options.backend = compact, strict, _BACKENDS[backend]
    if max_whitespace is not None:
        options.max_whitespace = max_whitespace
    request.speculative.num_draft_tokens = num_draft_tokens
    request.speculative.proposer = _PROPOSERS[proposer]
    return request


def build_tokenize_request(text: str | None = None, messages: Sequence[dict] | None = None):
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text, messages")
    if text is not None:
        return pb.TokenizeRequest(text=text)
    return pb.TokenizeRequest(chat=_chat(messages))


def to_chunk(response: pb.GenerateResponse) -> Chunk:
    guarantee = None
    if response.HasField("guarantee"):
        g = response.guarantee
        guarantee = Guarantee(g.backend, tuple(UnenforcedKeyword(u.keyword, u.pointer, u.reason)
                                               for u in g.unenforced), g.compile_ms, g.cache_hit,
                              tuple(UnenforcedKeyword(u.keyword, u.pointer, u.reason) for u in g.restricted))
    usage = None
    if response.HasField("usage"):
        u = response.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.draft_tokens_proposed,
                      u.draft_tokens_accepted, u.cached_prompt_tokens)
    validation = None
    if response.HasField("validation"):
        v = response.validation
        validation = Validation(v.valid, tuple((e.path, e.message) for e in v.errors),
                                _VALIDATION_STATUS.get(v.status, ""), v.num_errors)
    return Chunk(text=response.text, token_ids=tuple(response.token_ids),
                 logprobs=tuple(TokenLogprob(lp.token_id, lp.logprob,
                                             tuple((t.token_id, t.logprob) for t in lp.top))
                                for lp in response.logprobs),
                 guarantee=guarantee, finish_reason=_FINISH.get(response.finish_reason),
                 usage=usage, validation=validation, request_id=response.request_id)


def to_model_info(r: pb.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(r.model_name, r.vocab_size, tuple(r.eos_token_ids), r.device, r.max_prompt_tokens,
                     r.max_new_tokens_limit, r.default_max_tokens, r.max_grammar_bytes,
                     r.max_message_bytes, r.max_batch, r.max_draft_tokens, tuple(r.constraint_kinds),
                     r.prefix_caching)


def to_engine_stats(r: pb.GetEngineStatsResponse) -> EngineStats:
    return EngineStats(r.num_waiting, r.num_running, r.num_kv_pages_used, r.num_slots_used,
                       r.num_grammar_matchers, r.grammar_available, r.num_kv_pages_total,
                       r.num_finished, r.num_tokens_generated, r.num_draft_tokens_proposed,
                       r.num_draft_tokens_accepted, r.num_kv_pages_cached)
