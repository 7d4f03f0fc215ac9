"""config.json in the spellings found on the Hub, parsed into ModelConfig."""

from __future__ import annotations

import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from generation_service.model.architectures import parse_hf_config
from generation_service.model.layers import rope_inv_freq
from generation_service.model.presets import PRESETS

# Llama-3.1-8B-Instruct's config.json as published (transformers 4.43 spelling: rope_scaling + rope_theta).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}


def test_published_llama_31_config_equals_the_preset():
    assert parse_hf_config(LLAMA_31_8B) == PRESETS["llama-3.1-8b"]


def test_llama3_inv_freq_matches_transformers():
    config = parse_hf_config(LLAMA_31_8B)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in LLAMA_31_8B.items() if k != "architectures"})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_qwen3_explicit_head_dim_and_dtype_spellings():
    raw = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "num_attention_heads": 16,
           "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 28, "intermediate_size": 3072,
           "vocab_size": 151936, "rope_theta": 1000000, "tie_word_embeddings": True, "dtype": "bfloat16",
           "eos_token_id": 151645, "use_sliding_window": False, "sliding_window": None}
    config = parse_hf_config(raw)
    assert config.head_dim == 128 and config.qk_norm and not config.attention_bias
    assert config.dtype == "bfloat16" and config.torch_dtype == torch.bfloat16 and config.eos_token_ids == (151645,)
