"""FP8 checkpoints as users have them (compressed-tensors and Hugging Face fp8, made by the
compressed-tensors package) load into FP8 layers whose CPU forward matches compressed-tensors'
own dequantized forward; `--quantization fp8` quantizes a float checkpoint at load."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from fp8_fixtures import TINY_FP8, as_hf_fp8, make_fp8_checkpoint
from hf_reference import save_hf_checkpoint
from generation_service.engine.kv_cache import KVCache
from generation_service.model.config import ModelLoadError
from generation_service.model.forward_batch import build_forward_batch
from generation_service.model.loader import load_model
from generation_service.model.quantization.fp8 import FP8_DTYPE, FP8_MAX
from generation_service.model.quantization.linear import Fp8Linear

pytest.importorskip("compressed_tensors")
IDS = torch.randint(0, TINY_FP8["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(1))
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def logits(loaded, ids: torch.Tensor = IDS) -> torch.Tensor:
    config = loaded.config
    kv = KVCache(config.num_layers, 4, 16, config.num_kv_heads, config.head_dim, torch.float32, "cpu")
    batch = build_forward_batch([ids[0].tolist()], [0], [[1, 2]], logits="all")
    with torch.no_grad():
        return loaded.model(batch, kv)


def fp8_layers(loaded) -> list[Fp8Linear]:
    return [m for m in loaded.model.modules() if isinstance(m, Fp8Linear)]


@pytest.mark.parametrize("strategy,activation", [
    ("tensor", "static"), ("tensor", "dynamic"), ("channel", "static"), ("channel", "dynamic"),
    ("channel", "none"), ("block", "group"), ("block", "none")])
def test_compressed_tensors_checkpoint_matches_its_dequantized_forward(tmp_path, strategy, activation):
    reference = make_fp8_checkpoint(tmp_path, strategy, activation, IDS)
    loaded = load_model(str(tmp_path), dtype="float32")
    layers = fp8_layers(loaded)
    assert len(layers) == len(LINEARS) * TINY_FP8["num_hidden_layers"]
    assert all(layer.weight.dtype == FP8_DTYPE for layer in layers)
    assert loaded.model.lm_head.weight.dtype == torch.float32  # ignored by the checkpoint
    ours = logits(loaded)
    assert torch.allclose(ours, reference, rtol=0, atol=1e-5), (ours - reference).abs().max()


def test_hf_fp8_block_checkpoint_matches_its_dequantized_forward(tmp_path):
    reference = make_fp8_checkpoint(tmp_path, "block", "group", IDS)
    as_hf_fp8(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32")
    layer = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, Fp8Linear) and layer.block == (64, 64) and layer.group == 64
    assert torch.allclose(logits(loaded), reference, rtol=0, atol=1e-5)


def test_fp8_checkpoint_with_a_missing_scale_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file
    make_fp8_checkpoint(tmp_path, "channel", "dynamic", IDS)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing from the checkpoint.*layers.1.mlp.down_proj.weight_scale"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "awq"}, "quantization method 'awq' is not supported"),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     "only 8-bit float"),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                                 "symmetric": True},
                              "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                    "dynamic": True}}}},
     "dynamic per tensor are not supported"),
])
def test_unsupported_quantization_is_refused_with_what_is_supported(tmp_path, change, message):
    make_fp8_checkpoint(tmp_path, "channel", "dynamic", IDS)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(tmp_path))


def test_online_fp8_quantizes_every_decoder_linear_per_channel(tmp_path):
    torch.manual_seed(0)
    folder = save_hf_checkpoint(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_FP8)), tmp_path / "f")
    dense = load_model(str(folder), dtype="float32")
    loaded = load_model(str(folder), dtype="float32", quantization="fp8")
    layers = fp8_layers(loaded)
    assert len(layers) == len(LINEARS) * TINY_FP8["num_hidden_layers"]
    down = loaded.model.model.layers[1].mlp.down_proj
    original = dense.model.model.layers[1].mlp.down_proj.weight
    scale = original.abs().amax(1, keepdim=True) / FP8_MAX
    assert torch.equal(down.weight_scale, scale) and down.activation == "dynamic"
    assert torch.equal(down.dequantized_weight(), (original / scale).to(FP8_DTYPE).float() * scale)
    ours, theirs = logits(loaded), logits(dense)  # random weights: flat logits, so no argmax check
    # e4m3 keeps 3 mantissa bits: ~3.6 % rms rounding on each of weights and activations
    assert 0 < (ours - theirs).norm() / theirs.norm() < 0.1


def test_unknown_quantization_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="quantization 'int4' is not supported"):
        load_model(str(tmp_path), quantization="int4")
