"""Writing small Llama GGUF files with the `gguf` package, as llama.cpp's converter lays them out.

Matrices are stored in one chosen type: float types and the types `gguf` can quantize hold
quantized random weights; the K-quants, which `gguf` cannot quantize, hold random blocks
(every block a valid encoding, so any dequantizer must turn it into the same floats).
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
from tokenizers.pre_tokenizers import ByteLevel

Q = gguf.GGMLQuantizationType
# Shapes where every matrix row is a whole number of 256-value K-quant blocks.
SHAPE = dict(hidden=256, ffn=512, num_heads=4, num_kv_heads=2, num_layers=2)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """(tokens, merges) of a small byte-level BPE: specials, the 256 byte symbols, a few merges."""
    alphabet = sorted(ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o n"]
    merged = [m.replace(" ", "") for m in merges]
    return SPECIALS + alphabet + merged, merges


def _permute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (see gguf_weights.unpermute_rope)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def random_blocks(shape: tuple[int, int], qtype, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for ``shape`` values in ``qtype`` with no fp16 inf/NaN in them.

    Clearing bit 6 of every odd byte keeps each little-endian fp16's exponent below all-ones,
    wherever in the block the scales sit."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(shape[0], shape[1] // block_size * type_size), dtype=np.uint8)
    data[:, 1::2] &= 0xBF
    return data


def _encode(values: np.ndarray, type_name: str, rng: np.random.Generator):
    qtype = Q[type_name]
    if type_name == "F32":
        return values, None
    if type_name == "F16":
        return values.astype(np.float16), None
    try:
        return gguf.quants.quantize(values, qtype), qtype
    except NotImplementedError:
        return random_blocks(values.shape, qtype, rng), qtype


def write_llama_gguf(path: pathlib.Path, weight_type: str = "F32", *, tied: bool = True, seed: int = 0,
                     tokenizer: bool = True, architecture: str = "llama", metadata: dict | None = None,
                     extra_tensors: dict[str, np.ndarray] | None = None) -> pathlib.Path:
    """A random Llama of SHAPE with its matrices in ``weight_type`` (norms stay F32)."""
    rng = np.random.default_rng(seed)
    hidden, ffn, heads, kv_heads = SHAPE["hidden"], SHAPE["ffn"], SHAPE["num_heads"], SHAPE["num_kv_heads"]
    head_dim = hidden // heads
    tokens, merges = byte_level_vocab()
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(SHAPE["num_layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, value[0], value[1])

    def matrix(name: str, rows: int, cols: int, rope_heads: int | None = None) -> None:
        values = rng.normal(0.0, 0.05, size=(rows, cols)).astype(np.float32)
        if rope_heads:
            values = _permute_rope(values, rope_heads)
        data, raw = _encode(values, weight_type, rng)
        writer.add_tensor(name, data, raw_dtype=raw)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + rng.normal(0.0, 0.1, size=hidden)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden)
    for layer in range(SHAPE["num_layers"]):
        norm(f"blk.{layer}.attn_norm.weight")
        matrix(f"blk.{layer}.attn_q.weight", hidden, hidden, heads)
        matrix(f"blk.{layer}.attn_k.weight", kv_heads * head_dim, hidden, kv_heads)
        matrix(f"blk.{layer}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{layer}.attn_output.weight", hidden, hidden)
        norm(f"blk.{layer}.ffn_norm.weight")
        matrix(f"blk.{layer}.ffn_gate.weight", ffn, hidden)
        matrix(f"blk.{layer}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{layer}.ffn_down.weight", hidden, ffn)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", vocab, hidden)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
