"""Each way a checkpoint can be wrong gives one message naming the file and the problem."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from hf_reference import save_hf_checkpoint
from generation_service.model.config import ModelLoadError
from generation_service.model.loader import load_model
from generation_service.model.presets import PRESETS
from generation_service.model.random_init import build_on_meta
from generation_service.model.reference_generate import greedy_generate

TINY = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128)


@pytest.fixture()
def checkpoint(tmp_path):
    torch.manual_seed(0)
    return save_hf_checkpoint(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)), tmp_path / "ckpt")


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def expect_error(source, pattern):
    with pytest.raises(ModelLoadError, match=pattern):
        load_model(str(source))


def test_directory_not_found(tmp_path):
    expect_error(tmp_path / "nope", re.escape(f"{tmp_path / 'nope'}: not found (--model takes a checkpoint folder"))


def test_config_missing(checkpoint):
    (checkpoint / "config.json").unlink()
    expect_error(checkpoint, r"config\.json: missing \(a checkpoint directory needs config\.json")


def test_config_not_json(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    expect_error(checkpoint, r"config\.json: not valid JSON")


def test_unknown_architecture(checkpoint):
    edit_config(checkpoint, architectures=["GPT2LMHeadModel"])
    expect_error(checkpoint, r"config\.json: architecture 'GPT2LMHeadModel' is not supported "
                             r"\(supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM\)")


def test_missing_config_field(checkpoint):
    edit_config(checkpoint, hidden_size=None)
    expect_error(checkpoint, r"config\.json: missing field 'hidden_size'")


def test_unsupported_rope_type(checkpoint):
    edit_config(checkpoint, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    expect_error(checkpoint, r"config\.json: rope type 'yarn' is not supported \(supported: default, linear, llama3\)")


def test_no_safetensors(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    expect_error(checkpoint, r"ckpt: no \*\.safetensors weights found \(found pytorch_model\.bin; "
                             r"only safetensors is supported\)")


def test_shape_mismatch_names_file_and_tensor(checkpoint):
    edit_config(checkpoint, intermediate_size=256)
    expect_error(checkpoint, r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.(gate|up)_proj\.weight' "
                             r"has shape \(128, 64\), expected \(256, 64\) from config\.json")


def test_unreadable_safetensors(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"not a safetensors file")
    expect_error(checkpoint, r"model\.safetensors: cannot be read as safetensors")


def test_missing_tensor(checkpoint):
    weights = load_file(checkpoint / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, checkpoint / "model.safetensors")
    expect_error(checkpoint, r"tensor\(s\) missing from the checkpoint \(model\.safetensors\): lm_head\.weight")


def test_missing_shard(tmp_path):
    torch.manual_seed(0)
    folder = save_hf_checkpoint(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)), tmp_path,
                                max_shard_size="100KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    expect_error(folder, rf"model\.safetensors\.index\.json: shard '{re.escape(shard.name)}' is missing")


def test_sentencepiece_only_tokenizer(checkpoint):
    (checkpoint / "tokenizer.model").write_bytes(b"\0")
    expect_error(checkpoint, r"tokenizer\.json missing \(found only the SentencePiece tokenizer\.model")


def test_no_tokenizer_files_loads_without_tokenizer(checkpoint):
    assert load_model(str(checkpoint)).tokenizer is None


def test_unknown_random_preset():
    expect_error("random:llama-9", r"random:llama-9: unknown preset \(presets: llama-3\.1-8b, ")


def test_random_from_config_file_is_seeded_and_runs(checkpoint):
    first = load_model(f"random:{checkpoint / 'config.json'}", seed=7)
    second = load_model(f"random:{checkpoint / 'config.json'}", seed=7)
    other = load_model(f"random:{checkpoint / 'config.json'}", seed=8)
    weight = "model.layers.1.self_attn.q_proj.weight"
    w1, w2, w3 = (dict(m.model.named_parameters())[weight] for m in (first, second, other))
    assert torch.equal(w1, w2) and not torch.equal(w1, w3)
    assert 0.015 < w1.std().item() < 0.025
    assert first.config.hidden_size == 64
    result = greedy_generate(first.model, first.config, [[1, 2, 3]], 3, page_size=2)
    assert torch.isfinite(result.prefill_logits).all()


@pytest.mark.parametrize("preset, published", [
    ("llama-3.1-8b", 8_030_261_248), ("llama-3.2-1b", 1_235_814_400), ("qwen2.5-0.5b", 494_032_768),
    ("qwen3-0.6b", 596_049_920), ("mistral-7b", 7_248_023_552),
])
def test_presets_have_the_published_shapes(preset, published):
    model = build_on_meta(PRESETS[preset])  # shapes only, no storage
    assert sum(p.numel() for p in model.parameters()) == PRESETS[preset].num_parameters == published


def test_random_build_allocates_only_on_the_target_device(checkpoint):
    loaded = load_model(f"random:{checkpoint / 'config.json'}", dtype="bfloat16")
    params = list(loaded.model.parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) == loaded.config.num_parameters
    assert loaded.path == str(checkpoint) and loaded.tokenizer is None
