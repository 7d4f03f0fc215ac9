"""The served tokenizer as backends see it: stop ids, and a logits width wider than the vocabulary."""
from __future__ import annotations

import numpy as np

from channel_driver import allowed_tokens
from grammar_contract.spec import GrammarSpec
from grammar_service.backends import load_backend_class
from grammar_service.tokenizer import load_tokenizer

PADDED = 32768 + 64  # models often pad the logits width past the tokenizer's ids


def test_stop_ids_and_fingerprint_follow_the_mask_width(mistral_32k_dir):
    data, fingerprint = load_tokenizer(mistral_32k_dir, 32768)
    padded, padded_fingerprint = load_tokenizer(mistral_32k_dir, PADDED)
    assert data.stop_token_ids == (2,) and data.mask_words == 1024
    assert padded.mask_words == (PADDED + 31) // 32 and padded.encoded_vocab[32768:] == ("",) * 64
    assert fingerprint != padded_fingerprint


def test_padded_ids_are_never_allowed(mistral_32k_dir):
    data, _ = load_tokenizer(mistral_32k_dir, PADDED)
    backend = load_backend_class("xgrammar")(data, num_compile_threads=1, num_fill_threads=1)
    matcher = backend.new_matcher(backend.compile(GrammarSpec("json_schema", '{"type": "string"}')))
    assert matcher.accept(backend_token(data, '"'))
    masks = np.zeros((1, data.mask_words), np.int32)
    backend.batch_fill([matcher], masks, [0])
    allowed = allowed_tokens(masks[0])
    assert len(allowed) > 10_000 and allowed.max() < 32768


def backend_token(data, text: str) -> int:
    return data.encoded_vocab.index(text)
