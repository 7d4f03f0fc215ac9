"""Putting Fp8Linear layers into a model: before loading an FP8 checkpoint (on the meta
device, so the checkpoint's tensors are assigned as they are), or over a loaded model's
linear layers (`--quantization fp8`)."""
from __future__ import annotations

import logging

import torch
from torch import nn

from generation_service.model.quantization.linear import Fp8Linear
from generation_service.model.quantization.scheme import Fp8Scheme

log = logging.getLogger(__name__)
QUANTIZATION_METHODS = ("fp8",)  # --quantization choices


def _targets(model: nn.Module, scheme: Fp8Scheme) -> list[tuple[str, nn.Linear]]:
    """The decoder's linear layers the scheme quantizes; the LM head never (its logits feed
    the grammar masks and the sampler, and a tied head is the embedding)."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not name.endswith("lm_head") and scheme.applies_to(name)]


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def prepare_fp8_layers(model: nn.Module, scheme: Fp8Scheme) -> list[str]:
    """Swap the scheme's linear layers of a meta-device model for empty Fp8Linear ones;
    returns their names."""
    names = []
    for name, linear in _targets(model, scheme):
        with torch.device("meta"):
            _replace(model, name, Fp8Linear(linear.in_features, linear.out_features,
                                             linear.bias is not None, scheme))
        names.append(name)
    return names


def finish_fp8_layers(model: nn.Module, dtype: torch.dtype) -> int:
    """After the checkpoint's tensors are assigned: scales in their runtime form. On a GPU,
    layers the FP8 kernels do not take (block scales, per-group activations) are dequantized
    once into plain `dtype` layers: exact, at BF16's speed. Returns how many were."""
    num_dense = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Fp8Linear):
            continue
        module.finish_loading()
        if module.weight.is_cuda and not module.runs_fp8_kernels:
            dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device="meta")
            dense.weight = nn.Parameter(module.dequantized_weight(dtype), requires_grad=False)
            dense.bias = module.bias
            _replace(model, name, dense)
            num_dense += 1
    if num_dense:
        log.warning("%d block-scaled FP8 layers dequantized to %s: the GPU kernels take per-channel "
                    "scales only", num_dense, dtype)
    return num_dense


@torch.no_grad()
def quantize_model_(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Online FP8: each targeted linear layer of a loaded model replaced by its Fp8Linear
    (per-channel weight scales), one at a time, so the peak is one layer over the model.
    Returns the number of layers quantized."""
    targets = _targets(model, scheme)
    for name, linear in targets:
        _replace(model, name, Fp8Linear.from_linear(linear, scheme))
        linear.weight = None  # the high-precision copy goes now, not with the model
    log.info("quantized %d linear layers to FP8 e4m3 (per-channel weight scales, %s activations)",
             len(targets), scheme.activation)
    return len(targets)


def has_fp8_layers(model: nn.Module) -> bool:
    return any(isinstance(module, Fp8Linear) for module in model.modules())
