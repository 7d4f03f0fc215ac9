"""Reading safetensors checkpoints (single file or sharded with an index) into a model."""

from __future__ import annotations

import json
import logging
import math
import pathlib
from contextlib import contextmanager

import torch
from safetensors import safe_open
from torch import nn

from generation_service.model.config import ModelLoadError
from generation_service.model.quantization.fp8 import FP8_DTYPE

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that this decoder recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@contextmanager
def open_safetensors(path: pathlib.Path, device: str = "cpu"):
    """safe_open whose failures (truncated, not safetensors) name the file."""
    try:
        handle = safe_open(str(path), framework="pt", device=device)
    except Exception as error:  # safetensors raises SafetensorError and others
        raise ModelLoadError(f"{path}: cannot be read as safetensors ({error})") from None
    with handle:
        yield handle


def find_weight_files(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """tensor name -> file holding it, from the shard index or by listing *.safetensors."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError) as error:
            raise ModelLoadError(f"{index_path}: not a valid safetensors index ({error})") from None
        files = {name: folder / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ModelLoadError(f"{index_path}: shard '{shard.name}' is missing from {folder}")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (found {', '.join(others)}; only safetensors is supported)" if others else ""
        raise ModelLoadError(f"{folder}: no *.safetensors weights found{hint}")
    files = {}
    for shard in shards:
        with open_safetensors(shard) as handle:
            files.update({name: shard for name in handle.keys()})
    return files


def names_by_file(folder: pathlib.Path, expected) -> dict[pathlib.Path, list[str]]:
    """The model's tensor names (``expected``) grouped by the checkpoint file holding each; a
    tensor the checkpoint lacks is a ModelLoadError, tensors the model does not use a warning."""
    files = find_weight_files(folder)
    missing = sorted(set(expected) - set(files))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        names = ", ".join(sorted({p.name for p in files.values()}))
        raise ModelLoadError(f"{folder}: tensor(s) missing from the checkpoint ({names}): {shown}")
    unexpected = sorted(n for n in set(files) - set(expected) if not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        log.warning("%s: ignoring %d tensors the model does not use, e.g. %s", folder, len(unexpected), unexpected[0])
    by_file: dict[pathlib.Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    return by_file


def _load_dtype(name: str, param: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """FP8 weights stay FP8 and their scales fp32 (`model/quantization/`); the rest `dtype`."""
    if param.dtype == FP8_DTYPE:
        return FP8_DTYPE
    return torch.float32 if name.endswith("_scale") else dtype


def _shape_fits(name: str, shape: tuple, want: tuple) -> bool:
    """Scales may be stored as () or (1,) for one per tensor: the same number either way."""
    return shape == want or (name.endswith("_scale") and math.prod(shape) == math.prod(want))


def load_weights(model: nn.Module, folder: pathlib.Path, device: torch.device, dtype: torch.dtype,
                 renames: dict[str, str] | None = None) -> None:
    """Assign every parameter of ``model`` (built on the meta device) from the checkpoint.

    Tensors are read straight onto ``device`` and cast to ``dtype`` (FP8 weights and their
    scales keep theirs); each name and shape is checked against the model, and a mismatch
    names the file and the tensor. ``renames``: model parameter name -> the checkpoint's name
    where they differ (an FP8 format's scale names).
    """
    expected = dict(model.named_parameters())
    model_names = {(renames or {}).get(name, name): name for name in expected}  # checkpoint -> model
    by_file = names_by_file(folder, model_names)
    state = {}
    for path, names in sorted(by_file.items()):
        with open_safetensors(path, str(device)) as handle:
            for stored in names:
                name = model_names[stored]
                shape, want = tuple(handle.get_slice(stored).get_shape()), tuple(expected[name].shape)
                if not _shape_fits(name, shape, want):
                    raise ModelLoadError(
                        f"{path}: tensor '{stored}' has shape {shape}, expected {want} from config.json")
                state[name] = handle.get_tensor(stored).to(_load_dtype(name, expected[name], dtype))
    model.load_state_dict(state, strict=True, assign=True)
