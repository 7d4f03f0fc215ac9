"""Shared helpers of the GPU tests: small random Llama shapes, Tekken-131k vocab."""
from __future__ import annotations

import dataclasses
import os
import pathlib

import torch

TOKENIZER_DIR = pathlib.Path(os.environ.get(
    "STRUCTGEN_TEKKEN_DIR", pathlib.Path.home() / ".cache/structgen/tokenizers/tekken_131k"))
VOCAB = 131072
PAGE_SIZE = 16


def small_config(num_layers: int = 2):
    from generation_service.model.presets import PRESETS
    return dataclasses.replace(PRESETS["llama-3.2-1b"], num_layers=num_layers, vocab_size=VOCAB,
                               max_position_embeddings=4096)


def make_kv(config, num_pages: int, seed: int = 1):
    """A paged cache filled with random K/V (never zeros: they hide indexing bugs)."""
    from generation_service.engine.kv_cache import KVCache
    kv = KVCache(config.num_layers, num_pages, PAGE_SIZE, config.num_kv_heads, config.head_dim,
                 torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for t in kv.k + kv.v:
        t.normal_(0.0, 1.0, generator=gen)
    return kv


def load_rows(runner, batch: int, context_len: int, pages_per_row: int, seed: int = 2):
    """Rows 0..batch-1: row r owns pages 1 + r*pages_per_row..., feeds a random token at
    position context_len (its first context_len positions are the random cache)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch,), generator=gen)
    positions = torch.full((batch,), context_len, dtype=torch.int64)
    seq_lens = torch.full((batch,), context_len + 1, dtype=torch.int32)
    table = torch.stack([torch.arange(1 + r * pages_per_row, 1 + (r + 1) * pages_per_row,
                                      dtype=torch.int32) for r in range(batch)])
    runner.load_rows(ids, positions, seq_lens, table)
    return ids, table
