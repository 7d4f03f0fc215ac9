"""Named configs for ``random:<preset>``: published shapes, random weights (benchmarks)."""

from __future__ import annotations

from generation_service.model.config import ModelConfig, RopeScaling

_LLAMA31_ROPE = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
_LLAMA32_ROPE = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)


def _llama3(vocab_size=128256, **fields) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=vocab_size, rope_theta=500000.0,
                rope_scaling=_LLAMA31_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=False,
                attention_bias=False, qk_norm=False, max_position_embeddings=131072,
                eos_token_ids=(128001, 128008, 128009), dtype="bfloat16", bos_token_id=128000)
    return ModelConfig(**base | fields)


def _qwen(architecture: str, **fields) -> ModelConfig:
    base = dict(architecture=architecture, vocab_size=151936, rms_norm_eps=1e-6,
                attention_bias=architecture == "Qwen2ForCausalLM", qk_norm=architecture == "Qwen3ForCausalLM",
                rope_scaling=None, max_position_embeddings=32768, eos_token_ids=(151645, 151643),
                dtype="bfloat16")
    return ModelConfig(**base | fields)


PRESETS: dict[str, ModelConfig] = {
    "llama-3.1-8b": _llama3(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                            intermediate_size=14336),
    "llama-3.1-70b": _llama3(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                             intermediate_size=28672),
    "llama-3.2-1b": _llama3(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                            intermediate_size=8192, rope_scaling=_LLAMA32_ROPE, tie_word_embeddings=True),
    "llama-3.2-3b": _llama3(hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128,
                            intermediate_size=8192, rope_scaling=_LLAMA32_ROPE, tie_word_embeddings=True),
    "llama-2-7b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=32, head_dim=128, intermediate_size=11008, rope_theta=10000.0, rope_scaling=None,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
        max_position_embeddings=4096, eos_token_ids=(2,), dtype="float16", bos_token_id=1),
    "mistral-7b": ModelConfig(
        architecture="MistralForCausalLM", vocab_size=32768, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=14336, rope_theta=1000000.0, rope_scaling=None,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
        max_position_embeddings=32768, eos_token_ids=(2,), dtype="bfloat16", bos_token_id=1),
    "qwen2.5-7b": _qwen("Qwen2ForCausalLM", hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                        head_dim=128, intermediate_size=18944, rope_theta=1000000.0, vocab_size=152064,
                        tie_word_embeddings=False),
    "qwen2.5-0.5b": _qwen("Qwen2ForCausalLM", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                          head_dim=64, intermediate_size=4864, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3-0.6b": _qwen("Qwen3ForCausalLM", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                        head_dim=128, intermediate_size=3072, rope_theta=1000000.0, tie_word_embeddings=True,
                        max_position_embeddings=40960),
    "qwen3-8b": _qwen("Qwen3ForCausalLM", hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                      head_dim=128, intermediate_size=12288, rope_theta=1000000.0, tie_word_embeddings=False,
                      max_position_embeddings=40960),
}
