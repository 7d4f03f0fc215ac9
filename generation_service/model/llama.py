"""The Llama-family causal LM: Llama 2/3.x, Mistral, Qwen2/2.5 and Qwen3.

The four families share this decoder; their differences are flags on ModelConfig
(q/k/v bias, per-head q/k norm, sliding window, RoPE scaling) handled in ``layers.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from generation_service.engine.kv_cache import KVCache
from generation_service.model.config import ModelConfig
from generation_service.model.forward_batch import ForwardBatch
from generation_service.model.layers import DecoderLayer, RMSNorm, RotaryEmbedding


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (``model.*`` in Hugging Face checkpoints)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # NOTE: an explicit _weight skips Embedding's normal_ init, which on the meta device
        # imports torch._dynamo (seconds); the loader or random init fills the weight anyway.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(batch, kv) -> (L, vocab_size) fp32 logits of the tokens at batch.logits_indices."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied models reuse the embedding matrix as the output projection.
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, batch: ForwardBatch, kv: KVCache, layer_ids: Sequence[int] | None = None) -> torch.Tensor:
        """`layer_ids`: run only these decoder layers (self-speculative drafts, calibration); the
        others are skipped, their K/V at the batch's positions left unwritten."""
        # Out-of-range ids (garbage in padding rows) must not fault the gather.
        input_ids = batch.input_ids.clamp(0, self.config.vocab_size - 1)
        hidden = self.model.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary(batch.positions, hidden.dtype)
        for index in range(len(self.model.layers)) if layer_ids is None else layer_ids:
            hidden = self.model.layers[index](hidden, cos, sin, kv.layer(index), batch)
        # The final norm is per token, so norming only the returned rows is exact.
        hidden = self.model.norm(hidden[batch.logits_indices])  # (L, hidden)
        return F.linear(hidden, self.output_weight).float()  # (L, vocab)


MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
