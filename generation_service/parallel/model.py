"""The Llama-family decoder of one rank: model/llama.py's modules at the shard's widths, with
the row-parallel projections and the vocab-parallel embedding swapped in."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from generation_service.engine.kv_cache import KVCache
from generation_service.model.forward_batch import ForwardBatch
from generation_service.model.llama import MODEL_CLASSES, LlamaForCausalLM
from generation_service.parallel.group import TensorParallelGroup
from generation_service.parallel.layers import RowParallelLinear, VocabParallelEmbedding
from generation_service.parallel.plan import ShardPlan, TensorParallelError


class TensorParallelLM(LlamaForCausalLM):
    """forward(batch, kv) -> rank 0: (L, vocab_size) fp32 logits, as LlamaForCausalLM's; other
    ranks: None. Every rank must run it with the same batch (collectives inside)."""

    def __init__(self, plan: ShardPlan, group: TensorParallelGroup) -> None:
        local = plan.local
        super().__init__(local)
        self.plan, self.group = plan, group
        self.vocab_size = plan.full.vocab_size
        self.model.embed_tokens = VocabParallelEmbedding(local.vocab_size, local.hidden_size,
                                                         plan.vocab_start, group)
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            attention.o_proj = RowParallelLinear(attention.o_proj.in_features, local.hidden_size,
                                                 local.attention_out_bias, group)
            mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features, local.hidden_size,
                                              local.mlp_bias, group)

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor | None:
        input_ids = batch.input_ids.clamp(0, self.vocab_size - 1)
        hidden = self.model.embed_tokens(input_ids)  # (T, hidden), whole on every rank
        cos, sin = self.rotary(batch.positions, hidden.dtype)
        for index, layer in enumerate(self.model.layers):
            hidden = layer(hidden, cos, sin, kv.layer(index), batch)
        hidden = self.model.norm(hidden[batch.logits_indices])  # (L, hidden)
        local = F.linear(hidden, self.output_weight).float()  # (L, vocab_shard_size)
        logits = self.group.gather_columns(local)  # rank 0: (L, world_size * vocab_shard_size)
        return None if logits is None else logits[:, :self.vocab_size]


def build_on_meta(plan: ShardPlan, group: TensorParallelGroup) -> nn.Module:
    """The rank's module tree with no storage yet (the loader assigns each shard)."""
    if MODEL_CLASSES.get(plan.full.architecture) is not LlamaForCausalLM:
        raise TensorParallelError(f"--tensor-parallel: architecture {plan.full.architecture} has no "
                                  "sharded decoder")
    with torch.device("meta"):
        return TensorParallelLM(plan, group)
