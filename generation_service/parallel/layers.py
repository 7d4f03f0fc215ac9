"""The two sharded layers whose forward ends in a collective.

Column-parallel projections need none: each rank's plain nn.Linear produces its own heads or
intermediate features. These keep Hugging Face's parameter names, so a shard loads by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from generation_service.parallel.group import TensorParallelGroup


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_shard @ W_shard^T) + b: the weight holds this rank's input columns, the
    bias is whole and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [vocab_start, vocab_start + num_embeddings) of the embedding; a token
    outside them contributes zeros, so the all-reduce leaves every token its one row."""

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_start: int,
                 group: TensorParallelGroup) -> None:
        # NOTE: an explicit _weight skips the normal_ init (see model/llama.py).
        super().__init__(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        is_here = (local >= 0) & (local < self.num_embeddings)
        hidden = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)  # (T, hidden)
        hidden = hidden * is_here[:, None].to(hidden.dtype)
        return self.group.all_reduce(hidden)
