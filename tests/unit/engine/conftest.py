"""Tiny fixtures for engine unit tests: requests without a model, a character tokenizer."""
from __future__ import annotations

import pytest

from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from generation_service.engine.request import Request


def make_request(request_id: str = "r", prompt_len: int = 4, *, max_new_tokens: int = 16,
                 num_draft_tokens: int = 0, prompt=None, **sampling) -> Request:
    prompt = tuple(prompt) if prompt is not None else tuple(range(1, prompt_len + 1))
    spec = GenerationRequest(request_id, prompt, SamplingParams(max_new_tokens=max_new_tokens, **sampling),
                             speculative=SpeculativeParams(num_draft_tokens))
    return Request(spec, frozenset(spec.sampling.stop_token_ids), sample_seed=0)


class CharTokenizer:
    """Token id i <-> chr(i); enough for detokenization and stop-string tests."""

    vocab_size = 256
    eos_token_ids = (0,)
    byte_fallback_ids = frozenset()
    decodes_by_concatenation = True  # chr per id

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


@pytest.fixture
def char_tokenizer() -> CharTokenizer:
    return CharTokenizer()
