"""Reading safetensors checkpoints (single file or sharded with an index) into a model."""

from __future__ import annotations

import json
import logging
import pathlib
from contextlib import contextmanager

import torch
from safetensors import safe_open
from torch import nn

from generation_service.model.config import ModelLoadError

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


def load_weights(model: nn.Module, folder: pathlib.Path, device: torch.device, dtype: torch.dtype) -> None:
    """Assign every parameter of ``model`` (built on the meta device) from the checkpoint.

    Tensors are read straight onto ``device`` and cast to ``dtype``; each name and shape is
    checked against the model, and a mismatch names the file and the tensor.
    """
    expected = dict(model.named_parameters())
    by_file = names_by_file(folder, expected)
    state = {}
    for path, names in sorted(by_file.items()):
        with open_safetensors(path, str(device)) as handle:
            for name in names:
                tensor = handle.get_slice(name)
                shape, want = tuple(tensor.get_shape()), tuple(expected[name].shape)
                if shape != want:
                    raise ModelLoadError(
                        f"{path}: tensor '{name}' has shape {shape}, expected {want} from config.json")
                state[name] = handle.get_tensor(name).to(dtype)
    model.load_state_dict(state, strict=True, assign=True)
