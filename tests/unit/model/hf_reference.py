"""transformers as the reference: writing its checkpoints and scoring our generations."""

from __future__ import annotations

import pathlib

import torch


def save_hf_checkpoint(hf_model, folder: pathlib.Path, **kwargs) -> pathlib.Path:
    """Write a transformers model as safetensors, the way users' checkpoints are written."""
    hf_model.save_pretrained(str(folder), safe_serialization=True, **kwargs)
    return folder


@torch.no_grad()
def hf_step_logits(hf_model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits for every generation step, (len(generated), vocab) fp32.

    One uncached forward over prompt + generated[:-1]: row i is the logits after
    prompt + generated[:i], exactly what step i of a greedy decode computes. If each
    row's argmax equals generated[i], transformers' own greedy decode yields `generated`
    (by induction over the steps).
    """
    ids = torch.tensor([prompt + generated[:-1]])
    return hf_model(ids).logits[0, len(prompt) - 1 :].float()
