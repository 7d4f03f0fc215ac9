"""Seeded random weights built directly on the target device (benchmarks, the default model)."""

from __future__ import annotations

import torch
from torch import nn

from generation_service.model.config import ModelConfig
from generation_service.model.llama import MODEL_CLASSES

INIT_STD = 0.02


def build_on_meta(config: ModelConfig) -> nn.Module:
    """The model's module tree with no storage (meta device): nothing is allocated yet."""
    with torch.device("meta"):
        return MODEL_CLASSES[config.architecture](config)


@torch.no_grad()
def init_random_(model: nn.Module, seed: int, std: float = INIT_STD) -> nn.Module:
    """Norm weights 1, biases 0, everything else N(0, std), drawn in a fixed parameter order
    from a generator on the parameters' device, so a seed gives the same weights every time."""
    params = list(model.named_parameters())
    generator = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, param in params:
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)
    return model


def build_random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Random-weight model allocated once, on ``device``, in ``dtype`` (no CPU staging copy)."""
    model = build_on_meta(config).to(dtype=dtype)
    model.to_empty(device=device)
    return init_random_(model, seed).eval()
