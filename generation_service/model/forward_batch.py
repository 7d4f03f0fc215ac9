"""ForwardBatch: the one typed context a forward pass needs besides the weights and the cache."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class ForwardBatch:
    """One forward over B requests; their new tokens are flattened into T positions.

    Row b's new tokens occupy ``input_ids[start_b : start_b + extend_lens[b]]`` (row-major)
    and sit at absolute positions ``seq_lens[b] - extend_lens[b] ... seq_lens[b] - 1``.
    Token at position p is cached in page ``page_table[b, p // page_size]``.
    Padding rows (CUDA-graph buckets) have an all-zero page table, so whatever they write
    lands in the dummy page 0.
    """

    input_ids: torch.Tensor  # (T,) int64 new tokens of all rows, row-major
    positions: torch.Tensor  # (T,) int64 absolute position of each token
    page_table: torch.Tensor  # (B, max_pages_per_req) int32 physical page ids; unused entries = 0 (dummy page)
    seq_lens: torch.Tensor  # (B,) int32 total tokens in cache for the row after this forward (cached + new)
    extend_lens: torch.Tensor  # (B,) int32 new tokens of each row in this forward (sum == T)
    logits_indices: torch.Tensor  # (L,) int64 indices into T whose logits are returned

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @cached_property
    def token_rows(self) -> torch.Tensor:
        """(T,) int64 row index of every token; derived once, so build a new ForwardBatch per forward."""
        rows = torch.arange(self.num_rows, device=self.extend_lens.device)
        return torch.repeat_interleave(rows, self.extend_lens.long(), output_size=self.num_tokens)


def build_forward_batch(
    new_token_ids: list[list[int]],
    num_cached: list[int],
    page_tables: list[list[int]],
    *,
    logits: str = "last",
    max_pages_per_req: int | None = None,
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """ForwardBatch from Python lists (tests, eager paths; the GPU runner fills persistent buffers).

    ``num_cached[b]`` tokens of row b are already in the cache; ``new_token_ids[b]`` follow.
    ``logits``: "last" returns one row per request (its last new token), "all" every token.
    """
    if not len(new_token_ids) == len(num_cached) == len(page_tables):
        raise ValueError("new_token_ids, num_cached and page_tables need one entry per row")
    width = max_pages_per_req or max((len(t) for t in page_tables), default=1) or 1
    table = torch.zeros((len(page_tables), width), dtype=torch.int32)
    for row, pages in enumerate(page_tables):
        table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    flat_ids, positions, last_indices = [], [], []
    for ids, cached in zip(new_token_ids, num_cached):
        flat_ids.extend(ids)
        positions.extend(range(cached, cached + len(ids)))
        if ids:
            last_indices.append(len(flat_ids) - 1)
    if logits == "last":
        indices = last_indices
    elif logits == "all":
        indices = list(range(len(flat_ids)))
    else:
        raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
    extend = [len(ids) for ids in new_token_ids]
    return ForwardBatch(
        input_ids=torch.tensor(flat_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        page_table=table.to(device),
        seq_lens=torch.tensor([c + n for c, n in zip(num_cached, extend)], dtype=torch.int32, device=device),
        extend_lens=torch.tensor(extend, dtype=torch.int32, device=device),
        logits_indices=torch.tensor(indices, dtype=torch.int64, device=device),
    )
