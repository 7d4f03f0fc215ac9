"""The random model, KV cache and decode rows that the GPU decode benchmarks time (decode.py,
profile_step.py, kernels.py's gemv_decode, _roofline.py): bf16 weights drawn with seed 0, a cache
of random values in pages of PAGE_SIZE, every row at one context over its own pages.
"""
from __future__ import annotations

import dataclasses

import torch

from benchmarks._harness import PAGE_SIZE, VOCAB


def preset_shape(preset: str):
    """The preset's ModelConfig (generation_service/model/presets.py) with VOCAB and room for
    4096 positions."""
    from generation_service.model.presets import PRESETS

    return dataclasses.replace(PRESETS[preset], vocab_size=VOCAB, max_position_embeddings=4096)


def random_model(config):
    """`config`'s model with random bf16 weights (seed 0) on the GPU; `model.config` is `config`."""
    from generation_service.model.random_init import build_random_model

    return build_random_model(config, torch.device("cuda"), torch.bfloat16, seed=0)


def random_kv_cache(config, num_pages: int, dtype: torch.dtype = torch.bfloat16):
    """A KV cache of `num_pages` pages on the GPU in `dtype` (bf16, or KV_FP8 with scales 1.0),
    every value N(0, 1)."""
    from generation_service.engine.kv_cache import KVCache

    kv = KVCache(config.num_layers, num_pages, PAGE_SIZE, config.num_kv_heads, config.head_dim, dtype, "cuda")
    for t in kv.k + kv.v:
        if t.dtype == torch.bfloat16:
            t.normal_(0.0, 1.0)
        else:  # (no normal_ for float8: drawn in bf16, then rounded)
            t.copy_(torch.empty(t.shape, dtype=torch.bfloat16, device=t.device).normal_(0.0, 1.0))
    return kv


def pages_per_row(num_tokens: int) -> int:
    return -(-num_tokens // PAGE_SIZE)


def load_rows(runner, batch: int, context: int, num_row_pages: int, vocab_size: int = VOCAB) -> None:
    """Rows [0, batch) of `runner`: a random token at position `context`, row r over pages
    1 + r * num_row_pages onward (page 0 is the dummy page of padding rows)."""
    ids = torch.randint(0, vocab_size, (batch,))
    positions = torch.full((batch,), context, dtype=torch.int64)
    seq_lens = torch.full((batch,), context + 1, dtype=torch.int32)
    table = torch.arange(1, 1 + batch * num_row_pages, dtype=torch.int32).view(batch, num_row_pages)
    runner.load_rows(ids, positions, seq_lens, table)


def projection_inputs(config, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 inputs of `rows` rows to the projections: (hidden, q heads x head_dim,
    intermediate) wide, i.e. the inputs of qkv / gate_up and the LM head, of o_proj, of down."""
    def rand(width: int) -> torch.Tensor:
        return torch.randn(rows, width, dtype=torch.bfloat16, device="cuda")

    return rand(config.hidden_size), rand(config.num_heads * config.head_dim), rand(config.intermediate_size)
