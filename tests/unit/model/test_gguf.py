"""GGUF checkpoints: weights, config and tokenizer read as transformers reads the same file."""

from __future__ import annotations

import json
import pathlib
import warnings

import numpy as np
import pytest
import torch
import transformers

from gguf_fixtures import SHAPE, byte_level_vocab, write_llama_gguf
from hf_reference import hf_step_logits
from generation_service.model.config import ModelLoadError
from generation_service.model.gguf_weights import SUPPORTED_TENSOR_TYPES
from generation_service.model.loader import load_model
from generation_service.model.reference_generate import greedy_generate


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Converted tokenizers go to a temporary cache, never the user's."""
    monkeypatch.setenv("STRUCTGEN_CACHE", str(tmp_path / "cache"))


def load_hf(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("weight_type", SUPPORTED_TENSOR_TYPES)
def test_dequantizes_exactly_like_transformers(tmp_path, weight_type):
    """Every parameter equals transformers' own dequantization (and q/k row order) of the file."""
    path = write_llama_gguf(tmp_path / "model.gguf", weight_type, tied=weight_type != "Q8_0")
    ours = load_model(str(path), dtype="float32").model.state_dict()
    reference = load_hf(path).state_dict()
    assert set(ours) <= set(reference)
    for name, value in ours.items():
        assert value.abs().amax() > 0 and value.std() > 0, name
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=name)


def test_config_comes_from_the_metadata(tmp_path):
    loaded = load_model(str(write_llama_gguf(tmp_path / "model.gguf", "Q4_1", tied=False)))
    config = loaded.config
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (
        SHAPE["hidden"], SHAPE["ffn"], SHAPE["num_layers"])
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 64)
    assert config.vocab_size == len(byte_level_vocab()[0]) and not config.tie_word_embeddings
    assert config.eos_token_ids == (2,) and config.max_position_embeddings == 512
    assert config.dtype == "float32"  # quantized, served on the CPU
    assert loaded.path == str(tmp_path / "model.gguf")


def test_float_files_keep_their_dtype_and_dtype_overrides(tmp_path):
    path = write_llama_gguf(tmp_path / "model.gguf", "F16")
    assert next(load_model(str(path)).model.parameters()).dtype == torch.float16
    assert next(load_model(str(path), dtype="bfloat16").model.parameters()).dtype == torch.bfloat16


def test_greedy_decode_matches_transformers(tmp_path):
    path = write_llama_gguf(tmp_path / "model.gguf", "Q8_0", tied=False, seed=3)
    loaded = load_model(str(path))
    hf_model = load_hf(path)
    prompts = [[5, 40, 41, 42, 200, 7], list(range(60, 81))]
    result = greedy_generate(loaded.model, loaded.config, prompts, 12, prefill_chunk=8)
    for row, prompt in enumerate(prompts):
        reference = hf_step_logits(hf_model, prompt, result.output_ids[row])
        assert reference.argmax(-1).tolist() == result.output_ids[row]
        ours = torch.stack([result.prefill_logits[row]] + [step[row] for step in result.step_logits])
        assert (ours - reference).abs().max() < 1e-3


def test_a_folder_holding_one_gguf_file_loads(tmp_path):
    write_llama_gguf(tmp_path / "model.gguf")
    assert load_model(str(tmp_path)).path == str(tmp_path / "model.gguf")


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    loaded = load_model(str(write_llama_gguf(tmp_path / "model.gguf")))
    tokenizer = loaded.tokenizer
    assert tokenizer.eos_token_ids == (2,) and tokenizer.bos_token_id == 1
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "the tin"}])
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nthe tin<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == 1 and ids[-2:] == tokenizer.encode("assistant\n")[-2:]  # specials whole
    pieces = [tokenizer.id_to_token(i) for i in tokenizer.encode(" the tin 42")]
    assert pieces == ["Ġthe", "Ġt", "in", "Ġ", "4", "2"]  # merges applied, digits split one by one
    folder = tmp_path / "cache" / "gguf-tokenizers"
    assert [p for p in folder.iterdir()] == [pathlib.Path(tokenizer.path)]
    config = json.loads((pathlib.Path(tokenizer.path) / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and "chat_template" in config


def test_a_file_without_a_tokenizer_serves_token_ids(tmp_path):
    loaded = load_model(str(write_llama_gguf(tmp_path / "model.gguf", tokenizer=False)))
    assert loaded.tokenizer is None


@pytest.mark.parametrize("case,message", [
    ("tensor-type", r"tensor type\(s\) I8 \(e\.g\. extra\.weight\) not supported \(supported: F32, F16"),
    ("architecture", r"GGUF architecture 'qwen2' is not supported \(supported: llama\)"),
    ("rope-freqs", r"rope_freqs\.weight, Llama 3\.1\+ scaling\) are not supported"),
    ("pre-tokenizer", r"GGUF pre-tokenizer 'made-up' is not supported"),
])
def test_unsupported_files_are_refused_by_name(tmp_path, case, message):
    kwargs = {
        "tensor-type": dict(extra_tensors={"extra.weight": np.zeros(32, np.int8)}),
        "architecture": dict(architecture="qwen2"),
        "rope-freqs": dict(extra_tensors={"rope_freqs.weight": np.ones(32, np.float32)}),
        "pre-tokenizer": dict(tokenizer=False, metadata=_tokenizer_metadata("made-up")),
    }[case]
    path = write_llama_gguf(tmp_path / "model.gguf", **kwargs)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(path))


def _tokenizer_metadata(pre: str) -> dict:
    import gguf

    tokens, merges = byte_level_vocab()
    return {"tokenizer.ggml.model": ("gpt2", gguf.GGUFValueType.STRING),
            "tokenizer.ggml.pre": (pre, gguf.GGUFValueType.STRING),
            "tokenizer.ggml.tokens": (tokens, gguf.GGUFValueType.ARRAY),
            "tokenizer.ggml.merges": (merges, gguf.GGUFValueType.ARRAY)}


def test_bad_paths_are_one_clear_error(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match=r"junk\.gguf: cannot be read as GGUF"):
        load_model(str(tmp_path / "junk.gguf"))
    write_llama_gguf(tmp_path / "other.gguf")
    with pytest.raises(ModelLoadError, match=r"holds several GGUF files \(junk\.gguf, other\.gguf\)"):
        load_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"split GGUF files are not supported"):
        load_model(str(write_llama_gguf(tmp_path / "model-00001-of-00002.gguf")))
    with pytest.raises(ModelLoadError, match=r"missing: not found \(--model takes a checkpoint folder, "
                                             r"a \.gguf file, random:<preset> or a built-in name: default"):
        load_model(str(tmp_path / "missing"))


def _sentencepiece_gguf(path, model_file):
    """A GGUF holding only a SentencePiece vocabulary, as llama.cpp's converter writes one."""
    import gguf
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([p.piece for p in proto.pieces])
    writer.add_token_scores([p.score for p in proto.pieces])
    writer.add_token_types([int(p.type) for p in proto.pieces])  # SentencePiece's numbering is GGUF's
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_sentencepiece_vocabulary_encodes_like_sentencepiece(tmp_path, mistral_tokenizer):
    import sentencepiece

    from generation_service.model.gguf_reader import GgufFile
    from generation_service.model.gguf_tokenizer import ensure_gguf_tokenizer
    from generation_service.model.tiny_random_model import mistral_sentencepiece_path
    from generation_service.model.tokenizer import Tokenizer
    from test_tokenizer_detokenizer import TEXTS

    model_file = mistral_sentencepiece_path()
    path = _sentencepiece_gguf(tmp_path / "spm.gguf", model_file)
    tokenizer = Tokenizer(ensure_gguf_tokenizer(GgufFile.open(path)))
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    for text in TEXTS + [" leading space", "two  spaces"]:
        ids = processor.encode(text)
        assert tokenizer.encode(text) == [1] + ids, text  # BOS by default, as llama.cpp adds it
        assert tokenizer.decode(ids) == processor.decode(ids)
    for text in TEXTS + ["</s> in text"]:  # control tokens in the text are parsed, as transformers does
        assert tokenizer.encode(text) == mistral_tokenizer.encode(text)


def test_smollm2_tokenizer_matches_transformers_reading_of_the_file(smollm2_gguf):
    """The real file: the same ids as transformers' GGUF tokenizer, the chat template included."""
    from test_tokenizer_detokenizer import TEXTS

    loaded_tokenizer = load_model_tokenizer(smollm2_gguf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    for text in TEXTS + ["In 2024, 1234567 cats ate 3.14159 pies.", "<|im_start|>user\nhi<|im_end|>"]:
        assert loaded_tokenizer.encode(text) == reference.encode(text), text
        ids = reference.encode(text)
        assert loaded_tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids)
    messages = [{"role": "user", "content": "Give me JSON."}]
    assert loaded_tokenizer.apply_chat_template(messages) == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def load_model_tokenizer(path):
    from generation_service.model.gguf_reader import GgufFile
    from generation_service.model.gguf_tokenizer import ensure_gguf_tokenizer
    from generation_service.model.tokenizer import Tokenizer

    return Tokenizer(ensure_gguf_tokenizer(GgufFile.open(path)))


def test_an_unwritable_cache_falls_back_to_the_temporary_folder(tmp_path, monkeypatch):
    """A cache under a regular file cannot be created, even by root (as a read-only root
    filesystem refuses it): the conversion goes to the temporary folder instead."""
    import os
    import tempfile

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("STRUCTGEN_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    loaded = load_model(str(write_llama_gguf(tmp_path / "model.gguf")))
    assert loaded.tokenizer.path.startswith(str(tmp_path / "tmp" / f"structgen-{os.getuid()}" / "gguf-tokenizers"))
    assert [loaded.tokenizer.id_to_token(i) for i in loaded.tokenizer.encode(" the")] == ["Ġthe"]
