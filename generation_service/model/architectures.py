"""Hugging Face config.json -> ModelConfig, one small parser per architecture family.

Llama 2/3.x, Mistral, Qwen2/2.5 and Qwen3 share one decoder (``llama.py``); they differ
only in flags: Qwen2 has q/k/v bias, Qwen3 normalises q and k per head, Mistral may slide
its attention window, Llama 3.1+ scales RoPE frequencies.
"""

from __future__ import annotations

from typing import Any, Callable

from generation_service.model.config import ModelConfig, ModelLoadError, RopeScaling


def _require(raw: dict, key: str, source: str) -> Any:
    if key not in raw or raw[key] is None:
        raise ModelLoadError(f"{source}: missing field '{key}'")
    return raw[key]


def _rope(raw: dict, source: str) -> tuple[float, RopeScaling | None]:
    """Reads both spellings: transformers 5 `rope_parameters` and older `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if rope_type == "llama3":
        try:
            return theta, RopeScaling(
                "llama3", float(params["factor"]), float(params["low_freq_factor"]),
                float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
        except KeyError as missing:
            raise ModelLoadError(f"{source}: llama3 rope scaling lacks {missing}") from None
    raise ModelLoadError(f"{source}: rope type '{rope_type}' is not supported (supported: default, linear, llama3)")


def _eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


def _dtype(raw: dict) -> str:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def _common(raw: dict, source: str, architecture: str) -> dict[str, Any]:
    hidden = int(_require(raw, "hidden_size", source))
    num_heads = int(_require(raw, "num_attention_heads", source))
    theta, scaling = _rope(raw, source)
    return dict(
        architecture=architecture,
        vocab_size=int(_require(raw, "vocab_size", source)),
        hidden_size=hidden,
        num_layers=int(_require(raw, "num_hidden_layers", source)),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        intermediate_size=int(_require(raw, "intermediate_size", source)),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=False,
        qk_norm=False,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        eos_token_ids=_eos_ids(raw),
        dtype=_dtype(raw),
        bos_token_id=raw.get("bos_token_id"),
    )


def _check_activation(raw: dict, source: str) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act '{act}' is not supported (only silu)")


def _llama(raw: dict, source: str) -> ModelConfig:
    _check_activation(raw, source)
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(**_common(raw, source, "LlamaForCausalLM") | dict(
        attention_bias=bias, attention_out_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False))))


def _mistral(raw: dict, source: str) -> ModelConfig:
    _check_activation(raw, source)
    window = raw.get("sliding_window")
    return ModelConfig(**_common(raw, source, "MistralForCausalLM") | dict(
        sliding_window=int(window) if window else None))


def _reject_qwen_sliding(raw: dict, source: str) -> None:
    if raw.get("use_sliding_window"):
        raise ModelLoadError(f"{source}: use_sliding_window=true is not supported for Qwen models")


def _qwen2(raw: dict, source: str) -> ModelConfig:
    _check_activation(raw, source)
    _reject_qwen_sliding(raw, source)
    return ModelConfig(**_common(raw, source, "Qwen2ForCausalLM") | dict(attention_bias=True))


def _qwen3(raw: dict, source: str) -> ModelConfig:
    _check_activation(raw, source)
    _reject_qwen_sliding(raw, source)
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(**_common(raw, source, "Qwen3ForCausalLM") | dict(
        attention_bias=bias, attention_out_bias=bias, qk_norm=True))


CONFIG_PARSERS: dict[str, Callable[[dict, str], ModelConfig]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
}
SUPPORTED_ARCHITECTURES = tuple(CONFIG_PARSERS)


def parse_hf_config(raw: dict, source: str = "config.json") -> ModelConfig:
    """ModelConfig from a config.json dict; ``source`` names the file in error messages."""
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ModelLoadError(f"{source}: missing field 'architectures'")
    name = architectures[0]
    if name not in CONFIG_PARSERS:
        raise ModelLoadError(
            f"{source}: architecture '{name}' is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return CONFIG_PARSERS[name](raw, source)
