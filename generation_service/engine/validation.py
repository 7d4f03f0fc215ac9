"""Synchronous checks of a submitted request against the model and the engine's limits."""
from __future__ import annotations

from typing import TYPE_CHECKING

from generation_service.engine.errors import InvalidRequestError, LimitExceededError
from generation_service.engine.kv_cache import num_pages_for
from generation_service.engine.params import GenerationRequest
from generation_service.engine.speculative import PROPOSERS

if TYPE_CHECKING:
    from generation_service.engine.engine import Engine


def validate_request(spec: GenerationRequest, engine: "Engine") -> None:
    config, vocab_size = engine.config, engine.model_config.vocab_size
    num_prompt, max_new = len(spec.prompt_ids), spec.sampling.max_new_tokens
    bad = [t for t in spec.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    bad_bias = [t for t, _ in spec.sampling.logit_bias if t >= vocab_size]
    if bad_bias:
        raise InvalidRequestError(f"logit_bias token id {bad_bias[0]} is outside the vocabulary [0, {vocab_size})")
    if num_prompt > config.max_prompt_tokens:
        raise LimitExceededError(f"the prompt has {num_prompt} tokens; max_prompt_tokens is {config.max_prompt_tokens}")
    if max_new > config.max_new_tokens_limit:
        raise LimitExceededError(f"max_new_tokens {max_new} exceeds max_new_tokens_limit {config.max_new_tokens_limit}")
    max_positions = engine.model_config.max_position_embeddings
    if num_prompt + max_new > max_positions:
        raise LimitExceededError(f"prompt ({num_prompt}) + max_new_tokens ({max_new}) exceeds the model's "
                                 f"context of {max_positions} tokens")
    num_pages = num_pages_for(num_prompt + max_new, config.page_size)
    if num_pages > engine.allocator.num_pages - 1:
        raise LimitExceededError(f"prompt + max_new_tokens needs {num_pages} KV pages; the cache has "
                                 f"{engine.allocator.num_pages - 1}")
    if spec.sampling.stop_strings and engine.tokenizer is None:
        raise InvalidRequestError("stop_strings need a tokenizer; this model has none")
    if spec.is_constrained and engine.tokenizer is None:
        raise InvalidRequestError("constrained decoding needs a tokenizer; this model has none")
    if spec.speculative.num_draft_tokens and spec.speculative.proposer not in PROPOSERS:
        raise InvalidRequestError(f"unknown draft proposer {spec.speculative.proposer!r}; "
                                  f"available: {sorted(PROPOSERS)}")
