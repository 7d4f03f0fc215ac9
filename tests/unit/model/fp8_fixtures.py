"""Small FP8 checkpoints made by the compressed-tensors package, as llm-compressor makes them,
and the logits its own fake-quantized forward (transformers + compressed-tensors) gives: the
dequantized reference the loader is checked against."""
from __future__ import annotations

import json
import pathlib

import torch
import transformers
from safetensors.torch import load_file, save_file

TINY_FP8 = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
BLOCK = [64, 64]


def _scheme(strategy: str, activation: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = dict(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    if strategy == "block":
        weights["block_structure"] = BLOCK
    inputs = {"none": None,
              "dynamic": dict(strategy="token", dynamic=True),
              "group": dict(strategy="group", group_size=BLOCK[1], dynamic=True),
              "static": dict(strategy="tensor", dynamic=False)}[activation]
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights), input_activations=None
                              if inputs is None else QuantizationArgs(num_bits=8, type="float", symmetric=True, **inputs))


def _weight_range(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    if strategy == "tensor":
        return weight.min().reshape(1), weight.max().reshape(1)
    if strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    rows, cols = weight.shape
    blocks = weight.reshape(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
    return blocks.amin((1, 3)), blocks.amax((1, 3))


@torch.no_grad()
def _calibrate(model, strategy: str, ids: torch.Tensor) -> None:
    """Weight scales from each weight's range, static input scales from one forward's amax
    (what llm-compressor's min-max observers do)."""
    from compressed_tensors.quantization.lifecycle.helpers import disable_quantization, enable_quantization
    from compressed_tensors.quantization.utils import calculate_qparams

    quantized = {name: module for name, module in model.named_modules() if hasattr(module, "weight_scale")}
    amax: dict[str, float] = {}
    hooks = [module.register_forward_pre_hook(
        lambda _, args, name=name: amax.__setitem__(name, max(amax.get(name, 0.0), args[0].abs().max().item())))
        for name, module in quantized.items()]
    model.apply(disable_quantization)
    model(ids)
    for hook in hooks:
        hook.remove()
    for name, module in quantized.items():
        low, high = _weight_range(module.weight, strategy)
        scale, _ = calculate_qparams(low, high, module.quantization_scheme.weights)
        module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale"):
            module.input_scale.fill_(amax[name] / 448)
    model.apply(enable_quantization)


@torch.no_grad()
def make_fp8_checkpoint(folder: pathlib.Path, strategy: str, activation: str,
                        ids: torch.Tensor) -> torch.Tensor:
    """A compressed-tensors FP8 checkpoint of a seeded tiny Llama in `folder`; returns the
    reference logits of `ids` (1, T): compressed-tensors' fake-quantized forward."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_FP8)).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    config = QuantizationConfig(config_groups={"group_0": _scheme(strategy, activation)}, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config, show_progress=False)
    _calibrate(model, strategy, ids)
    reference = model(ids).logits[0].float()
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    for path in folder.glob("*.safetensors"):
        path.unlink()
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()},
              str(folder / "model.safetensors"))
    compressor.update_config(str(folder))
    return reference


def as_hf_fp8(folder: pathlib.Path) -> None:
    """Rewrite a block-scaled compressed-tensors checkpoint in Hugging Face's `fp8` form
    (DeepSeek-V3 / Qwen3 FP8): scales named weight_scale_inv, `weight_block_size`."""
    state = load_file(str(folder / "model.safetensors"))
    state = {name.replace(".weight_scale", ".weight_scale_inv"): tensor for name, tensor in state.items()}
    save_file(state, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": BLOCK}
    (folder / "config.json").write_text(json.dumps(config))
