"""GGUF metadata -> ModelConfig, for the Llama architecture (``general.architecture = llama``).

llama.cpp writes Llama 2/3.x, Mistral, SmolLM and TinyLlama checkpoints under that one
architecture; the keys are prefixed with it (``llama.embedding_length``, ...).
"""

from __future__ import annotations

from generation_service.model.config import ModelConfig, ModelLoadError, RopeScaling
from generation_service.model.gguf_reader import GgufFile

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
# Float tensor types a checkpoint can be served in as stored; any other type is quantized.
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _rope_scaling(file: GgufFile, arch: str) -> RopeScaling | None:
    if "rope_freqs.weight" in file.tensors:
        raise ModelLoadError(f"{file.path}: per-dimension RoPE frequencies (rope_freqs.weight, Llama 3.1+ "
                             "scaling) are not supported in GGUF yet; use the safetensors checkpoint")
    kind = file.value(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(file.require(f"{arch}.rope.scaling.factor")))
    raise ModelLoadError(f"{file.path}: rope scaling '{kind}' is not supported (supported: none, linear)")


def _eos_ids(file: GgufFile) -> tuple[int, ...]:
    """EOS plus the end-of-turn / end-of-message ids llama.cpp also stops on."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return tuple(dict.fromkeys(int(file.value(key)) for key in keys if file.has(key)))


def weights_dtype(file: GgufFile) -> str | None:
    """The float dtype every matrix is stored in; None when any tensor is quantized."""
    names = {tensor.tensor_type.name for tensor in file.tensors.values() if len(tensor.shape) > 1}
    dtypes = {FLOAT_TYPES.get(name) for name in names}
    return dtypes.pop() if len(dtypes) == 1 and None not in dtypes else None


def read_gguf_config(file: GgufFile) -> ModelConfig:
    """ModelConfig from the file's metadata; ``dtype`` is the stored float type, float32 if quantized."""
    arch = file.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{file.path}: GGUF architecture '{arch}' is not supported "
                             f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")
    if int(file.value(f"{arch}.expert_count", 0) or 0) > 0:
        raise ModelLoadError(f"{file.path}: mixture-of-experts GGUF models are not supported")
    if "token_embd.weight" not in file.tensors:
        raise ModelLoadError(f"{file.path}: tensor 'token_embd.weight' is missing")
    hidden = int(file.require(f"{arch}.embedding_length"))
    num_heads = int(file.require(f"{arch}.attention.head_count"))
    head_dim = int(file.value(f"{arch}.attention.key_length", hidden // num_heads))
    rope_dims = int(file.value(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(f"{file.path}: partial rotary embeddings ({rope_dims} of {head_dim} dims) "
                             "are not supported")
    bos = file.value("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=int(file.tensors["token_embd.weight"].shape[1]),  # GGUF shapes are innermost first
        hidden_size=hidden,
        num_layers=int(file.require(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(file.value(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate_size=int(file.require(f"{arch}.feed_forward_length")),
        rope_theta=float(file.value(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(file, arch),
        rms_norm_eps=float(file.value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in file.tensors,
        attention_bias="blk.0.attn_q.bias" in file.tensors,
        attention_out_bias="blk.0.attn_output.bias" in file.tensors,
        mlp_bias="blk.0.ffn_up.bias" in file.tensors,
        qk_norm=False,
        max_position_embeddings=int(file.value(f"{arch}.context_length", 4096)),
        eos_token_ids=_eos_ids(file),
        dtype=weights_dtype(file) or "float32",
        bos_token_id=None if bos is None else int(bos),
    )
