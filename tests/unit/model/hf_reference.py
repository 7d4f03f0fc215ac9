"""transformers as the reference: writing its checkpoints and running its greedy decode."""

from __future__ import annotations

import pathlib

import torch


def save_hf_checkpoint(hf_model, folder: pathlib.Path, **kwargs) -> pathlib.Path:
    """Write a transformers model as safetensors, the way users' checkpoints are written."""
    hf_model.save_pretrained(str(folder), safe_serialization=True, **kwargs)
    return folder


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], num_steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """transformers' last-position logits and greedy token for ``num_steps`` steps (no cache: full forwards)."""
    ids = torch.tensor([prompt])
    logits_per_step, generated = [], []
    for _ in range(num_steps):
        logits = hf_model(ids).logits[0, -1].float()
        token = int(logits.argmax())
        logits_per_step.append(logits)
        generated.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return logits_per_step, generated
