"""Greedy generation through the paged KV cache, eagerly, with the fewest moving parts.

Not the engine: a reference loop for tests and for checking a model by hand. It exercises
what the engine relies on: page tables, batched rows of different lengths, chunked
prefill and padding rows that write into the dummy page.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from generation_service.engine.kv_cache import KVCache, PageAllocator, num_pages_for
from generation_service.model.config import ModelConfig
from generation_service.model.forward_batch import build_forward_batch


@dataclass
class _Row:
    token_ids: list[int]
    num_cached: int = 0
    pages: list[int] = field(default_factory=list)


@dataclass
class GreedyResult:
    prefill_logits: torch.Tensor  # (B, vocab) logits after each prompt's last token
    step_logits: list[torch.Tensor]  # per decode step, (B, vocab)
    output_ids: list[list[int]]  # generated ids per row (first one from the prefill logits)


def _ensure_pages(row: _Row, num_tokens: int, allocator: PageAllocator, page_size: int) -> None:
    need = num_pages_for(num_tokens, page_size) - len(row.pages)
    if need > 0:
        row.pages += allocator.allocate(need)


@torch.no_grad()
def greedy_generate(model: nn.Module, config: ModelConfig, prompts: list[list[int]], max_new_tokens: int, *,
                    page_size: int = 16, prefill_chunk: int | None = None, num_padding_rows: int = 0,
                    device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> GreedyResult:
    """Prefill all prompts (in chunks of ``prefill_chunk`` tokens), then decode batched.

    ``num_padding_rows`` extra rows with zero page tables ride along in every decode step,
    as CUDA-graph padding does; they must not change any real row's logits.
    """
    dtype = dtype or next(model.parameters()).dtype
    max_len = max(len(p) for p in prompts) + max_new_tokens
    pages_per_row = num_pages_for(max_len, page_size)
    allocator = PageAllocator(len(prompts) * pages_per_row + 1)
    kv = KVCache(config.num_layers, allocator.num_pages, page_size, config.num_kv_heads, config.head_dim,
                 dtype, device)
    rows = [_Row(list(p)) for p in prompts]
    chunk = prefill_chunk or max_len
    last_logits: dict[int, torch.Tensor] = {}
    while any(r.num_cached < len(r.token_ids) for r in rows):
        new_ids = [r.token_ids[r.num_cached : r.num_cached + chunk] for r in rows]
        for row, ids in zip(rows, new_ids):
            _ensure_pages(row, row.num_cached + len(ids), allocator, page_size)
        batch = build_forward_batch(new_ids, [r.num_cached for r in rows], [r.pages for r in rows],
                                    max_pages_per_req=pages_per_row, device=device)
        logits = model(batch, kv)
        active = [i for i, ids in enumerate(new_ids) if ids]
        for out_row, i in enumerate(active):
            rows[i].num_cached += len(new_ids[i])
            last_logits[i] = logits[out_row]
    prefill_logits = torch.stack([last_logits[i] for i in range(len(rows))])
    outputs = [[int(prefill_logits[i].argmax())] for i in range(len(rows))]
    step_logits = []
    for _ in range(max_new_tokens - 1):
        new_ids = [[out[-1]] for out in outputs] + [[0]] * num_padding_rows
        for row, ids in zip(rows, new_ids):
            _ensure_pages(row, row.num_cached + 1, allocator, page_size)
        cached = [r.num_cached for r in rows] + [0] * num_padding_rows
        tables = [r.pages for r in rows] + [[]] * num_padding_rows
        batch = build_forward_batch(new_ids, cached, tables, max_pages_per_req=pages_per_row, device=device)
        logits = model(batch, kv)[: len(rows)]
        step_logits.append(logits)
        for row, out, row_logits in zip(rows, outputs, logits):
            row.num_cached += 1
            out.append(int(row_logits.argmax()))
    return GreedyResult(prefill_logits, step_logits, outputs)
