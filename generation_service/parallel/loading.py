"""A rank's shard of the model, cut as each tensor is read: no rank holds a full copy.

    safetensors   each tensor's slice is read through `get_slice` (only this rank's rows or
                  columns leave the file)
    GGUF          a tensor is dequantized whole, then cut (one tensor at a time)
    random:<preset>  each tensor is drawn whole in the order and from the generator of
                  `random_init.init_random_` and cut, so TP=N serves the weights TP=1 serves
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from generation_service.model import loader, random_init
from generation_service.model.config import ModelConfig, ModelLoadError, dtype_name
from generation_service.model.presets import PRESETS
from generation_service.model.tokenizer import load_tokenizer
from generation_service.model.weights import names_by_file, open_safetensors
from generation_service.parallel.group import TensorParallelGroup
from generation_service.parallel.model import build_on_meta
from generation_service.parallel.plan import ShardPlan
from structgen.builtin_models import resolve_builtin

log = logging.getLogger(__name__)


def cut(plan: ShardPlan, name: str, full_shape: tuple[int, ...],
        read: Callable[[tuple[slice, ...]], torch.Tensor]) -> torch.Tensor:
    """This rank's part of tensor `name`; `read(index)` returns full[index]. The vocabulary's
    padded tail (past the last row) is zeros."""
    shard = plan.shard_range(name, full_shape)
    if shard is None:
        return read((slice(None),))
    dim, wanted = shard
    stop = min(wanted.stop, full_shape[dim])
    index = (slice(None),) * dim + (slice(wanted.start, stop),)
    part = read(index)
    missing = wanted.stop - stop
    if missing > 0:
        pad_shape = list(part.shape)
        pad_shape[dim] = missing
        part = torch.cat((part, part.new_zeros(pad_shape)), dim=dim)
    return part


@dataclass(frozen=True)
class ModelSource:
    """What a --model value names, read from its config files only."""

    config: ModelConfig
    kind: str                        # "random" | "safetensors" | "gguf"
    path: pathlib.Path | None        # the checkpoint folder or .gguf file; None for random presets
    tokenizer_folder: pathlib.Path | None = None  # random:<config.json> beside a tokenizer.json


def model_source(source: str) -> ModelSource:
    builtin = resolve_builtin(source)
    source = source if builtin is None else str(builtin)
    if source.startswith(loader.RANDOM_PREFIX):
        spec = source[len(loader.RANDOM_PREFIX):]
        if spec in PRESETS:
            return ModelSource(PRESETS[spec], "random", None)
        config_path = pathlib.Path(spec)
        config_path = config_path / "config.json" if config_path.is_dir() else config_path
        return ModelSource(loader.read_config(config_path), "random", None, config_path.parent)
    path = pathlib.Path(source).expanduser()
    gguf_path = None if (path / "config.json").is_file() else loader.find_gguf_file(path)
    if gguf_path is not None:
        from generation_service.model.gguf_config import read_gguf_config
        from generation_service.model.gguf_reader import GgufFile
        return ModelSource(read_gguf_config(GgufFile.open(gguf_path)), "gguf", gguf_path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a checkpoint folder or a .gguf file")
    return ModelSource(loader.read_config(path / "config.json"), "safetensors", path, path)


def serving_dtype(source: ModelSource, device: torch.device, dtype: str | None) -> torch.dtype:
    """As load_model chooses: the given dtype, else the checkpoint's; a quantized GGUF file is
    served in float32 on the CPU and bfloat16 on a GPU."""
    if dtype not in (None, "auto"):
        return loader.dtype_from_name(dtype)
    if source.kind != "gguf":
        return source.config.torch_dtype
    from generation_service.model.gguf_config import weights_dtype
    from generation_service.model.gguf_reader import GgufFile
    name = weights_dtype(GgufFile.open(source.path))
    if name is not None:
        return loader.dtype_from_name(name)
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _random_state(model: nn.Module, plan: ShardPlan, device, dtype, seed: int) -> dict[str, torch.Tensor]:
    full = dict(random_init.build_on_meta(plan.full).named_parameters())
    generator = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, _ in model.named_parameters():  # NOTE: the order init_random_ draws in
        shape = tuple(full[name].shape)
        if name.endswith("norm.weight"):
            whole = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            whole = torch.zeros(shape, dtype=dtype, device=device)
        else:
            whole = torch.empty(shape, dtype=dtype, device=device).normal_(
                0.0, random_init.INIT_STD, generator=generator)
        state[name] = cut(plan, name, shape, lambda index: whole[index]).clone()
        del whole
    return state


def _safetensors_state(model: nn.Module, plan: ShardPlan, folder: pathlib.Path, device, dtype):
    expected = dict(model.named_parameters())
    by_file = names_by_file(folder, expected)
    state = {}
    for path, names in sorted(by_file.items()):
        with open_safetensors(path, str(device)) as handle:
            for name in names:
                slicer = handle.get_slice(name)  # reads only the indexed part from the file
                shape = tuple(slicer.get_shape())
                part = cut(plan, name, shape, lambda index: slicer[index])
                if part.shape != expected[name].shape:
                    raise ModelLoadError(f"{path}: tensor '{name}' has shape {shape}, which does not fit "
                                         f"config.json (this rank's part should be {tuple(expected[name].shape)})")
                state[name] = part.to(dtype)
    return state


def _gguf_state(model: nn.Module, plan: ShardPlan, path: pathlib.Path, device, dtype):
    from generation_service.model import gguf_weights
    from generation_service.model.gguf_reader import GgufFile

    file = GgufFile.open(path)
    gguf_weights.check_tensor_types(file)
    names, config = gguf_weights.gguf_name_map(plan.full), plan.full
    state = {}
    for name, _ in model.named_parameters():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name not in file.tensors:
            raise ModelLoadError(f"{path}: tensor '{gguf_name}' (for {name}) is missing")
        whole = gguf_weights.read_tensor(file.tensors[gguf_name])
        if ".self_attn.q_proj." in name:  # per head: cutting whole heads afterwards is exact
            whole = gguf_weights.unpermute_rope(whole, config.num_heads)
        elif ".self_attn.k_proj." in name:
            whole = gguf_weights.unpermute_rope(whole, config.num_kv_heads)
        state[name] = cut(plan, name, tuple(whole.shape), lambda index: whole[index]).to(device, dtype)
    return state


def load_shard(source: str, group: TensorParallelGroup, dtype: str | None, seed: int) -> loader.LoadedModel:
    """This rank's shard of --model `source` on the group's device. The LoadedModel's config is
    the whole model's (what the engine, tokenizer and sampler see); `model.config` the shard's."""
    found = model_source(source)
    device = group.device
    torch_dtype = serving_dtype(found, device, dtype)
    config = dataclasses.replace(found.config, dtype=dtype_name(torch_dtype))
    plan = ShardPlan(group.rank, group.world_size, config)
    model = build_on_meta(plan, group)
    if found.kind == "random":
        state = _random_state(model, plan, device, torch_dtype, seed)
    elif found.kind == "gguf":
        state = _gguf_state(model, plan, found.path, device, torch_dtype)
    else:
        state = _safetensors_state(model, plan, found.path, device, torch_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    log.info("rank %d of %d: loaded its shard of %s (%.1fM of %.1fM parameters) on %s in %s", group.rank,
             group.world_size, source, sum(p.numel() for p in model.parameters()) / 1e6,
             config.num_parameters / 1e6, device, torch_dtype)
    path = None if found.path is None else str(found.path)
    return loader.LoadedModel(model.eval(), config, _tokenizer(found), path)


def _tokenizer(found: ModelSource):
    if found.kind == "gguf":
        from generation_service.model.gguf_reader import GgufFile
        from generation_service.model.gguf_tokenizer import ensure_gguf_tokenizer
        from generation_service.model.tokenizer import Tokenizer
        file = GgufFile.open(found.path)
        return Tokenizer(ensure_gguf_tokenizer(file), found.config.vocab_size) \
            if file.has("tokenizer.ggml.tokens") else None
    folder = found.tokenizer_folder
    if folder is None or (found.kind == "random" and not (folder / "tokenizer.json").is_file()):
        return None
    return load_tokenizer(folder, found.config.vocab_size)
