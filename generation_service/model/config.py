"""ModelConfig: everything the decoder needs to know about a checkpoint, typed and frozen."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A checkpoint or config that cannot be loaded; the message names the file and the problem."""


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
           "float": "float32"}.get(name, name)
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (supported: {', '.join(_DTYPES)})")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in _DTYPES.items() if value == dtype)


@dataclass(frozen=True)
class RopeScaling:
    """Non-default RoPE frequency scaling ("linear" or "llama3"); None in ModelConfig = plain RoPE."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None  # llama3 only
    high_freq_factor: float | None = None  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 only


@dataclass(frozen=True)
class ModelConfig:
    """One Llama-family decoder. Names follow the engine's vocabulary, not Hugging Face's."""

    architecture: str  # Hugging Face class name, e.g. "LlamaForCausalLM"
    vocab_size: int  # logits width (may exceed the tokenizer's own count)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    dtype: str  # the checkpoint's dtype name: "float32" | "bfloat16" | "float16"
    # Additions beyond the first interface:
    attention_out_bias: bool = False  # bias on o_proj (Llama attention_bias=True has it; Qwen2 not)
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral: each query sees at most this many keys
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        dtype_from_name(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_parameters(self) -> int:
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        attention = h * q + 2 * h * kv + q * h
        attention += (q + 2 * kv if self.attention_bias else 0) + (h if self.attention_out_bias else 0)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        per_layer = attention + mlp + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h
