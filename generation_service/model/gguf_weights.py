"""GGUF tensors -> the model's parameters: dequantized at load to the serving dtype.

The engine computes in a float dtype, so quantized blocks are expanded once here (by the
`gguf` package's own dequantizers) and the file's memory map is dropped afterwards.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from generation_service.model.config import ModelConfig, ModelLoadError
from generation_service.model.gguf_reader import GgufFile

log = logging.getLogger(__name__)

# Types whose dequantization is tested against transformers' (tests/unit/model/test_gguf.py).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def check_tensor_types(file: GgufFile) -> None:
    """Refuse, before any tensor is read, a file holding a type we do not dequantize."""
    unsupported: dict[str, str] = {}
    for name, tensor in file.tensors.items():
        unsupported.setdefault(tensor.tensor_type.name, name)
    for type_name in SUPPORTED_TENSOR_TYPES:
        unsupported.pop(type_name, None)
    if unsupported:
        found = ", ".join(f"{kind} (e.g. {name})" for kind, name in sorted(unsupported.items()))
        raise ModelLoadError(f"{file.path}: tensor type(s) {found} not supported "
                             f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")


def unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: it interleaves each head's two rotary halves
    (rows 0, d/2, 1, d/2+1, ...) for its rotate-pairs RoPE; this decoder rotates halves."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def read_tensor(tensor) -> torch.Tensor:
    import gguf

    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32, numpy (rows, cols)
    if not values.flags.writeable:  # F32 is a view of the read-only memory map
        values = values.copy()
    return torch.from_numpy(values)


def gguf_name_map(config: ModelConfig):
    import gguf

    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_layers)


def load_gguf_weights(model: nn.Module, file: GgufFile, config: ModelConfig, device: torch.device,
                      dtype: torch.dtype) -> None:
    """Assign every parameter of ``model`` (built on the meta device) from the GGUF tensors."""
    check_tensor_types(file)
    names = gguf_name_map(config)
    tensors = file.tensors
    state = {}
    for name, param in model.named_parameters():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name not in tensors:
            raise ModelLoadError(f"{file.path}: tensor '{gguf_name}' (for {name}) is missing")
        value = read_tensor(tensors[gguf_name])
        if tuple(value.shape) != tuple(param.shape):
            raise ModelLoadError(f"{file.path}: tensor '{gguf_name}' has shape {tuple(value.shape)}, "
                                 f"expected {tuple(param.shape)} from the metadata")
        if ".self_attn.q_proj." in name:
            value = unpermute_rope(value, config.num_heads)
        elif ".self_attn.k_proj." in name:
            value = unpermute_rope(value, config.num_kv_heads)
        state[name] = value.to(device=device, dtype=dtype)
    unused = sorted(set(tensors) - {names.get_name(n, try_suffixes=(".weight", ".bias")) for n in state})
    if unused:
        log.warning("%s: ignoring %d tensors the model does not use, e.g. %s", file.path, len(unused), unused[0])
    model.load_state_dict(state, strict=True, assign=True)

