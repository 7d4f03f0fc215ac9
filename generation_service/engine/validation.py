"""Synchronous checks of a submitted request against the model and the engine's limits."""
from __future__ import annotations

from dataclasses import dataclass

from generation_service.engine.errors import InvalidRequestError, LimitExceededError
from generation_service.engine.kv_cache import num_pages_for
from generation_service.engine.params import GenerationRequest
from generation_service.engine.speculative import proposer_names

@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the model's and the engine's limits (the Engine
    builds it once)."""

    vocab_size: int
    max_positions: int         # the model's context
    max_prompt_tokens: int
    max_new_tokens_limit: int
    page_size: int
    num_usable_pages: int      # KV pages a request may hold (all but the dummy page)
    has_tokenizer: bool


def validate_request(spec: GenerationRequest, limits: RequestLimits) -> None:
    vocab_size = limits.vocab_size
    num_prompt, max_new = len(spec.prompt_ids), spec.sampling.max_new_tokens
    bad = [t for t in spec.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    bad_bias = [t for t, _ in spec.sampling.logit_bias if t >= vocab_size]
    if bad_bias:
        raise InvalidRequestError(f"logit_bias token id {bad_bias[0]} is outside the vocabulary [0, {vocab_size})")
    if num_prompt > limits.max_prompt_tokens:
        raise LimitExceededError(f"the prompt has {num_prompt} tokens; max_prompt_tokens is {limits.max_prompt_tokens}")
    if max_new > limits.max_new_tokens_limit:
        raise LimitExceededError(f"max_new_tokens {max_new} exceeds max_new_tokens_limit {limits.max_new_tokens_limit}")
    max_positions = limits.max_positions
    if num_prompt + max_new > max_positions:
        raise LimitExceededError(f"prompt ({num_prompt}) + max_new_tokens ({max_new}) exceeds the model's "
                                 f"context of {max_positions} tokens")
    num_pages = num_pages_for(num_prompt + max_new, limits.page_size)
    if num_pages > limits.num_usable_pages:
        raise LimitExceededError(f"prompt + max_new_tokens needs {num_pages} KV pages; the cache has "
                                 f"{limits.num_usable_pages}")
    if spec.sampling.stop_strings and not limits.has_tokenizer:
        raise InvalidRequestError("stop_strings need a tokenizer; this model has none")
    if spec.is_constrained and not limits.has_tokenizer:
        raise InvalidRequestError("constrained decoding needs a tokenizer; this model has none")
    if spec.speculative.num_draft_tokens and spec.speculative.proposer not in proposer_names():
        raise InvalidRequestError(f"unknown draft proposer {spec.speculative.proposer!r}; "
                                  f"available: {proposer_names()}")
