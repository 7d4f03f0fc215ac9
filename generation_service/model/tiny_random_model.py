"""The built-in `tiny-random` model: Llama architecture, Mistral's 32k SentencePiece
tokenizer, seeded random weights, written once as an ordinary checkpoint directory.

It exists so fast tests and CPU benchmarks have a model with a real tokenizer, no download
and a forward of a few milliseconds. Its weights are random, so its text is noise;
constrained decoding still turns that noise into valid output. Building it needs the
`models` extra (mistral-common for the tokenizer file, sentencepiece + transformers to
convert it); loading it needs neither.
"""

from __future__ import annotations

import importlib
import json
import logging
import pathlib

import torch
from safetensors.torch import save_file

from generation_service.model.config import ModelConfig, ModelLoadError
from generation_service.model.random_init import build_random_model
from structgen.cache_dir import cache_root, ensure_folder

log = logging.getLogger(__name__)

SEED = 0
# Bump when the files change: a cache folder is never rewritten in place.
FOLDER_NAME = "tiny-random-v2"
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}
# Mistral's instruct format: system text folded into the first user turn.
CHAT_TEMPLATE = (
    "{%- set system = messages[0]['content'] + '\\n\\n' if messages and messages[0]['role'] == 'system' else '' -%}"
    "{{- bos_token -}}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- if message['role'] == 'user' -%}[INST] {{ system if loop.first else '' }}{{ message['content'] }} [/INST]"
    "{%- elif message['role'] == 'assistant' -%}{{ message['content'] }}{{ eos_token }}"
    "{%- else -%}{{ raise_exception('roles must be system, user or assistant, got ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
TOKENIZER_CONFIG = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    # The generic class uses tokenizer.json as written; transformers 5's LlamaTokenizer would
    # rebuild the normalizer and stop matching SentencePiece on leading spaces.
    "tokenizer_class": "PreTrainedTokenizerFast",
    "chat_template": CHAT_TEMPLATE,
}


def mistral_sentencepiece_path() -> pathlib.Path:
    """Mistral 7B v0.1's tokenizer.model (32000 pieces, byte fallback) shipped in mistral-common."""
    import mistral_common

    return pathlib.Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"


def convert_sentencepiece(model_file: pathlib.Path):
    """tokenizers.Tokenizer equivalent to the SentencePiece model (legacy Llama behaviour,
    which encodes exactly as SentencePieceProcessor does), with <s> prepended on encode."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SpmConverter

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    vocab = {piece.piece: index for index, piece in enumerate(proto.pieces)}
    tokenizer = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])])
    return tokenizer


def write_tiny_random_model(folder: pathlib.Path) -> None:
    """Write the checkpoint files into ``folder`` (which must exist)."""
    convert_sentencepiece(mistral_sentencepiece_path()).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    (folder / "config.json").write_text(json.dumps(HF_CONFIG, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    from generation_service.model.architectures import parse_hf_config

    config: ModelConfig = parse_hf_config(HF_CONFIG)
    model = build_random_model(config, torch.device("cpu"), torch.float32, seed=SEED)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _check_build_dependencies() -> None:
    missing = []
    for module in ("mistral_common", "sentencepiece", "transformers"):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ModelLoadError(f"building the tiny-random model needs {', '.join(missing)}: "
                             "pip install 'structgen[models]' (or pass a checkpoint directory)")


def tiny_random_model_dir() -> pathlib.Path:
    return cache_root() / FOLDER_NAME


def ensure_tiny_random_model(folder: pathlib.Path | None = None) -> pathlib.Path:
    """The model's directory, created on first use (atomically, see cache_dir.ensure_folder)."""
    folder = folder or tiny_random_model_dir()
    if not (folder / "config.json").is_file():
        _check_build_dependencies()
        log.info("creating the built-in tiny-random model in %s (once; a few seconds)", folder)
    return ensure_folder(folder, "config.json", write_tiny_random_model)
