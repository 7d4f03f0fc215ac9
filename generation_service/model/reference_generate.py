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


class _PagedRows:
    """The requests, their pages and the cache: what an engine's scheduler would own."""

    def __init__(self, model: nn.Module, config: ModelConfig, prompts: list[list[int]], max_len: int,
                 page_size: int, device: torch.device | str, dtype: torch.dtype) -> None:
        self.model, self.device, self.page_size = model, device, page_size
        self.pages_per_row = num_pages_for(max_len, page_size)
        self.allocator = PageAllocator(len(prompts) * self.pages_per_row + 1)
        self.kv = KVCache(config.num_layers, self.allocator.num_pages, page_size, config.num_kv_heads,
                          config.head_dim, dtype, device)
        self.rows = [_Row(list(p)) for p in prompts]
        # Padding rows carry an out-of-range id: the model must clamp it, like CUDA-graph garbage.
        self.padding_id = config.vocab_size + 7

    def forward(self, new_ids: list[list[int]], num_padding_rows: int = 0) -> torch.Tensor:
        """Run one forward of ``new_ids`` per row (+ padding rows); logits of each non-empty row's last token."""
        for row, ids in zip(self.rows, new_ids):
            need = num_pages_for(row.num_cached + len(ids), self.page_size) - len(row.pages)
            row.pages += self.allocator.allocate(max(need, 0))
        batch = build_forward_batch(
            new_ids + [[self.padding_id]] * num_padding_rows,
            [r.num_cached for r in self.rows] + [0] * num_padding_rows,
            [r.pages for r in self.rows] + [[]] * num_padding_rows,
            max_pages_per_req=self.pages_per_row, device=self.device)
        logits = self.model(batch, self.kv)
        for row, ids in zip(self.rows, new_ids):
            row.num_cached += len(ids)
        return logits

    def prefill(self, chunk: int) -> torch.Tensor:
        """(B, vocab) logits after each prompt, prefilling ``chunk`` tokens per row per forward."""
        last_logits: dict[int, torch.Tensor] = {}
        while any(r.num_cached < len(r.token_ids) for r in self.rows):
            new_ids = [r.token_ids[r.num_cached : r.num_cached + chunk] for r in self.rows]
            active = [i for i, ids in enumerate(new_ids) if ids]  # rows done earlier return no logits
            for row_index, logits in zip(active, self.forward(new_ids)):
                last_logits[row_index] = logits
        return torch.stack([last_logits[i] for i in range(len(self.rows))])


@torch.no_grad()
def greedy_generate(model: nn.Module, config: ModelConfig, prompts: list[list[int]], max_new_tokens: int, *,
                    page_size: int = 16, prefill_chunk: int | None = None, num_padding_rows: int = 0,
                    device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> GreedyResult:
    """Prefill all prompts (in chunks of ``prefill_chunk`` tokens), then decode batched.

    ``num_padding_rows`` extra rows with zero page tables ride along in every decode step,
    as CUDA-graph padding does; they must not change any real row's logits.
    """
    max_len = max(len(p) for p in prompts) + max_new_tokens
    rows = _PagedRows(model, config, prompts, max_len, page_size, device,
                      dtype or next(model.parameters()).dtype)
    prefill_logits = rows.prefill(prefill_chunk or max_len)
    outputs = [[int(logits.argmax())] for logits in prefill_logits]
    step_logits = []
    for _ in range(max_new_tokens - 1):
        logits = rows.forward([[out[-1]] for out in outputs], num_padding_rows)[: len(prompts)]
        step_logits.append(logits)
        for out, row_logits in zip(outputs, logits):
            out.append(int(row_logits.argmax()))
    return GreedyResult(prefill_logits, step_logits, outputs)
