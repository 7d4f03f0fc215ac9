"""Which linear layers of a checkpoint hold FP8 weights, and how: `Fp8Scheme`, parsed from
config.json's `quantization_config` in its two FP8 forms, or made for `--quantization fp8`.

- compressed-tensors (`quant_method: compressed-tensors`, format `float-quantized`, as
  llm-compressor writes it): 8-bit float weights with per-tensor, per-channel or block scales
  (`weight_scale`), activations static per tensor (`input_scale`), dynamic per token, or not
  quantized; `ignore` and group `targets` select the layers.
- Hugging Face fp8 (`quant_method: fp8`, DeepSeek-V3 / Qwen3 FP8 checkpoints): e4m3 weights
  with `weight_block_size` block scales (`weight_scale_inv`, a multiplier despite its name) and
  dynamic activations per token and block column, or per-tensor `weight_scale`;
  `modules_to_not_convert` selects the layers kept in the model's dtype.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from generation_service.model.config import ModelLoadError

WEIGHT_STRATEGIES = ("tensor", "channel", "block")
ACTIVATIONS = ("dynamic", "static", "none")  # per token (block: per token and group) / per tensor / bf16


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 e4m3 linear layers. `block` (rows, cols) only for the block strategy."""

    weight_strategy: str  # WEIGHT_STRATEGIES
    activation: str  # ACTIVATIONS
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"  # the checkpoint's name of the weight scale tensor
    targets: tuple[str, ...] = ("Linear",)  # "Linear" or "re:<pattern>" on module names
    ignore: tuple[str, ...] = ("lm_head",)  # module names or "re:<pattern>"
    kv_cache_scales: bool = False  # the checkpoint carries self_attn.k_scale / v_scale
    source: str = "online"  # "compressed-tensors" | "fp8" | "online"
    activation_group: int | None = None  # dynamic: one scale per token and this many columns

    def __post_init__(self) -> None:
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"weight strategy {self.weight_strategy!r}: not one of {WEIGHT_STRATEGIES}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: not one of {ACTIVATIONS}")
        if (self.block is not None) != (self.weight_strategy == "block"):
            raise ValueError("a block size goes with the block strategy, and only with it")

    def applies_to(self, module_name: str) -> bool:
        """Whether the linear layer `module_name` (e.g. model.layers.0.mlp.down_proj) is FP8."""
        if any(_matches(pattern, module_name) for pattern in self.ignore):
            return False
        return any(target == "Linear" or _matches(target, module_name) for target in self.targets)


ONLINE_FP8 = Fp8Scheme("channel", "dynamic")  # --quantization fp8: vLLM's online FP8


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def parse_quantization_config(raw: dict | None, source: str) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json's `quantization_config` (None: not quantized). Any other
    quantization is a ModelLoadError naming what is supported."""
    if raw is None:
        return None
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw, source)
    if method == "fp8":
        return _hf_fp8(raw, source)
    raise ModelLoadError(f"{source}: quantization method {method!r} is not supported "
                         "(supported: compressed-tensors FP8, fp8)")


def _compressed_tensors(raw: dict, source: str) -> Fp8Scheme:
    groups = list((raw.get("config_groups") or {}).values())
    if not groups:
        raise ModelLoadError(f"{source}: compressed-tensors quantization_config has no config_groups")
    schemes = {_ct_group(group, source) for group in groups}
    if len(schemes) > 1:
        raise ModelLoadError(f"{source}: config groups with different FP8 schemes are not supported")
    weight_strategy, activation, block, group = schemes.pop()
    targets = tuple(dict.fromkeys(t for group in groups for t in group.get("targets") or ()))
    kv = raw.get("kv_cache_scheme")
    if kv is not None and not (kv.get("type") == "float" and kv.get("num_bits") == 8):
        raise ModelLoadError(f"{source}: kv_cache_scheme {kv} is not supported (8-bit float only)")
    return Fp8Scheme(weight_strategy, activation, block, "weight_scale", targets,
                     tuple(raw.get("ignore") or ()), kv is not None, "compressed-tensors", group)


def _ct_group(group: dict, source: str) -> tuple[str, str, tuple[int, int] | None, int | None]:
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if not (weights.get("type") == "float" and weights.get("num_bits") == 8):
        raise ModelLoadError(f"{source}: weights {weights.get('num_bits')}-bit {weights.get('type')}: "
                             "only 8-bit float (FP8) compressed-tensors checkpoints are supported")
    if weights.get("dynamic") or weights.get("symmetric") is False:
        raise ModelLoadError(f"{source}: FP8 weights must be static and symmetric")
    strategy = weights.get("strategy")
    if strategy not in WEIGHT_STRATEGIES:
        raise ModelLoadError(f"{source}: FP8 weight strategy {strategy!r} is not supported "
                             f"(supported: {', '.join(WEIGHT_STRATEGIES)})")
    block = tuple(weights["block_structure"]) if strategy == "block" else None
    if inputs is None:
        return strategy, "none", block, None
    if not (inputs.get("type") == "float" and inputs.get("num_bits") == 8):
        raise ModelLoadError(f"{source}: input activations must be FP8 or unquantized")
    kind = inputs.get("strategy")
    if inputs.get("dynamic") and kind in ("token", "group"):
        return strategy, "dynamic", block, inputs.get("group_size") if kind == "group" else None
    if not inputs.get("dynamic") and kind == "tensor":
        return strategy, "static", block, None
    raise ModelLoadError(f"{source}: input activations {'dynamic' if inputs.get('dynamic') else 'static'} "
                         f"per {kind} are not supported (dynamic per token or static per tensor)")


def _hf_fp8(raw: dict, source: str) -> Fp8Scheme:
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"{source}: fp8 format {raw.get('fmt')!r} is not supported (e4m3 only)")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(f"{source}: activation_scheme {scheme!r} is not supported (dynamic, static)")
    ignore = tuple(raw.get("modules_to_not_convert") or ()) + ("lm_head",)
    block = raw.get("weight_block_size")
    if block is None:
        return Fp8Scheme("tensor", scheme, None, "weight_scale", ignore=ignore, source="fp8")
    if scheme != "dynamic":
        raise ModelLoadError(f"{source}: block-scaled fp8 weights need dynamic activations")
    return Fp8Scheme("block", "dynamic", (int(block[0]), int(block[1])), "weight_scale_inv",
                     ignore=ignore, source="fp8", activation_group=int(block[1]))
