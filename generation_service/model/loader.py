"""load_model: a checkpoint directory, a GGUF file, a built-in model, or random weights.

    load_model("/models/Llama-3.1-8B-Instruct")   # config.json + *.safetensors + tokenizer.json
    load_model("/models/smollm2.Q4_K_M.gguf")      # GGUF (or a folder holding one), dequantized at load
    load_model("default")                          # built-in (structgen/builtin_models.py), fetched once, then as above
    load_model("random:llama-3.1-8b", device="cuda")  # preset shape, seeded random weights
    load_model("random:/path/config.json")         # any supported config.json, random weights
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from dataclasses import dataclass

import torch
from torch import nn

from generation_service.model.architectures import parse_hf_config
from structgen.builtin_models import BUILTIN_MODELS, resolve_builtin
from generation_service.model.config import ModelConfig, ModelLoadError, dtype_from_name, dtype_name
from generation_service.model.gguf_reader import find_gguf_file
from generation_service.model.presets import PRESETS
from generation_service.model.quantization.apply import (
    QUANTIZATION_METHODS, finish_fp8_layers, prepare_fp8_layers, quantize_model_)
from generation_service.model.quantization.scheme import ONLINE_FP8, parse_quantization_config
from generation_service.model.random_init import build_on_meta, build_random_model
from generation_service.model.tokenizer import Tokenizer, load_tokenizer
from generation_service.model.weights import load_weights

log = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"


@dataclass
class LoadedModel:
    model: nn.Module  # .forward(batch: ForwardBatch, kv: KVCache) -> (L, vocab_size) fp32 logits
    config: ModelConfig
    tokenizer: Tokenizer | None
    path: str | None  # checkpoint directory or GGUF file; None for random presets


def read_config(config_path: pathlib.Path) -> ModelConfig:
    """ModelConfig from a config.json, with generation_config.json's EOS ids merged in."""
    return parse_hf_config(read_raw_config(config_path), str(config_path))


def read_raw_config(config_path: pathlib.Path) -> dict:
    """config.json as a dict, with generation_config.json's EOS ids merged in."""
    if not config_path.is_file():
        raise ModelLoadError(f"{config_path}: missing (a checkpoint directory needs config.json, "
                             "*.safetensors and tokenizer.json)")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ModelLoadError(f"{config_path}: not valid JSON ({error})") from None
    generation_path = config_path.parent / "generation_config.json"
    if generation_path.is_file():
        eos = json.loads(generation_path.read_text(encoding="utf-8")).get("eos_token_id")
        if eos is not None:
            merged = [raw.get("eos_token_id")] if isinstance(raw.get("eos_token_id"), int) else list(raw.get("eos_token_id") or [])
            merged += [eos] if isinstance(eos, int) else list(eos)
            raw["eos_token_id"] = list(dict.fromkeys(merged))
    return raw


def _resolve_dtype(dtype: torch.dtype | str | None, config: ModelConfig) -> torch.dtype:
    return config.torch_dtype if dtype in (None, "auto") else dtype_from_name(dtype)


def load_gguf(path: pathlib.Path, device: torch.device, dtype: torch.dtype | str | None) -> LoadedModel:
    """A GGUF file: config and tokenizer from its metadata, weights dequantized to the serving dtype.

    ``dtype`` None keeps a float file's own type; a quantized file is served in float32 on
    the CPU (bfloat16 matmuls are slow there) and bfloat16 on a GPU.
    """
    from generation_service.model.gguf_config import read_gguf_config, weights_dtype
    from generation_service.model.gguf_reader import GgufFile
    from generation_service.model.gguf_tokenizer import ensure_gguf_tokenizer
    from generation_service.model.gguf_weights import load_gguf_weights

    file = GgufFile.open(path)
    config = read_gguf_config(file)
    if dtype not in (None, "auto"):
        torch_dtype = dtype_from_name(dtype)
    elif weights_dtype(file) is not None:
        torch_dtype = dtype_from_name(weights_dtype(file))
    else:
        torch_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = dataclasses.replace(config, dtype=dtype_name(torch_dtype))
    tokenizer = None
    if file.has("tokenizer.ggml.tokens"):
        tokenizer = Tokenizer(ensure_gguf_tokenizer(file), config.vocab_size)
    else:
        log.warning("%s: no tokenizer in the GGUF metadata; requests must carry token ids", path)
    model = build_on_meta(config)
    load_gguf_weights(model, file, config, device, torch_dtype)
    log.info("loaded %s (GGUF, %.1fM parameters) on %s in %s", path, config.num_parameters / 1e6, device,
             torch_dtype)
    return LoadedModel(model.eval(), config, tokenizer, str(path))


def load_checkpoint(folder: pathlib.Path, device: torch.device, dtype: torch.dtype | str | None,
                    quantization: str | None = None) -> LoadedModel:
    if not folder.exists():
        raise ModelLoadError(f"{folder}: not found (--model takes a checkpoint folder, a .gguf file, "
                             f"random:<preset> or a built-in name: {', '.join(BUILTIN_MODELS)})")
    if not (folder / "config.json").is_file():
        gguf_path = find_gguf_file(folder)
        if gguf_path is not None:
            return _quantized(load_gguf(gguf_path, device, dtype), quantization)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: not a checkpoint folder or a .gguf file")
    raw = read_raw_config(folder / "config.json")
    config = parse_hf_config(raw, str(folder / "config.json"))
    scheme = parse_quantization_config(raw.get("quantization_config"), str(folder / "config.json"))
    torch_dtype = _resolve_dtype(dtype, config)
    tokenizer = load_tokenizer(folder, config.vocab_size)
    model = build_on_meta(config)
    renames = {}
    if scheme is not None:
        names = prepare_fp8_layers(model, scheme)
        renames = {f"{name}.weight_scale": f"{name}.{scheme.scale_name}" for name in names}
    load_weights(model, folder, device, torch_dtype, renames)
    if scheme is not None:
        finish_fp8_layers(model, torch_dtype)
        log.info("%s: %d FP8 linear layers (%s, %s weight scales, %s activations)", folder, len(names),
                 scheme.source, scheme.weight_strategy, scheme.activation)
    log.info("loaded %s (%s, %.1fM parameters) on %s in %s", folder, config.architecture,
             config.num_parameters / 1e6, device, torch_dtype)
    loaded = LoadedModel(model.eval(), config, tokenizer, str(folder))
    return loaded if scheme is not None else _quantized(loaded, quantization)


def _quantized(loaded: LoadedModel, quantization: str | None) -> LoadedModel:
    """--quantization fp8 over a model loaded in its float dtype (a checkpoint that is FP8
    already keeps its own scales)."""
    if quantization is None:
        return loaded
    quantize_model_(loaded.model, ONLINE_FP8)
    return loaded


def load_random(spec: str, device: torch.device, dtype: torch.dtype | str | None, seed: int) -> LoadedModel:
    """``spec`` is a preset name or a path to a config.json (a folder holding one also works)."""
    tokenizer, path = None, None
    if spec in PRESETS:
        config = PRESETS[spec]
    elif spec.endswith(".json") or pathlib.Path(spec).exists():
        config_path = pathlib.Path(spec)
        config_path = config_path / "config.json" if config_path.is_dir() else config_path
        config = read_config(config_path)
        if (config_path.parent / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(config_path.parent, config.vocab_size)
        path = str(config_path.parent)
    else:
        raise ModelLoadError(f"random:{spec}: unknown preset (presets: {', '.join(PRESETS)}; "
                             "or give a path to a config.json)")
    model = build_random_model(config, device, _resolve_dtype(dtype, config), seed)
    log.info("built random %s (%.1fM parameters) on %s", spec, config.num_parameters / 1e6, device)
    return LoadedModel(model, config, tokenizer, path)


def load_model(source: str, *, device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None,
               seed: int = 0, quantization: str | None = None) -> LoadedModel:
    """The model named by ``source``; ``dtype`` None or "auto" keeps the checkpoint's (config.json "dtype").
    ``quantization`` "fp8": the decoder's linear layers quantized to FP8 at load (an FP8
    checkpoint is FP8 with or without it).

    Raises ModelLoadError with one message naming the file and what is wrong.
    """
    if quantization not in (None, *QUANTIZATION_METHODS):
        raise ModelLoadError(f"quantization {quantization!r} is not supported "
                             f"(supported: {', '.join(QUANTIZATION_METHODS)})")
    device = torch.device(device)
    builtin = resolve_builtin(source)
    source = source if builtin is None else str(builtin)
    if source.startswith(RANDOM_PREFIX):
        return _quantized(load_random(source[len(RANDOM_PREFIX):], device, dtype, seed), quantization)
    return load_checkpoint(pathlib.Path(source).expanduser(), device, dtype, quantization)
