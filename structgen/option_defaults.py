"""The default of each `structgen serve` setting, read from the config dataclasses, for --help.

The defaults live once, in ServeConfig and EngineConfig; --help quotes them from there so
the text cannot drift from what a server without the flag does.
"""
from __future__ import annotations

import dataclasses

# Settings whose unset value (None or 0) reads better in words.
_SHOWN_AS = {"dtype": "auto", "num_pages": "sized by the engine", "overlap": "true under CUDA graphs",
             "grammar_address": "spawn a child", "health_port": "off", "metrics_port": "off"}


def default_text(target: str, field: str) -> str:
    """How the default of ``field`` of the "serve" or "engine" config reads in --help."""
    from generation_service.config import ServeConfig
    from generation_service.engine.config import EngineConfig

    config = {"serve": ServeConfig, "engine": EngineConfig}[target]
    value = next(f.default for f in dataclasses.fields(config) if f.name == field)
    if field in _SHOWN_AS:
        return _SHOWN_AS[field]
    if value is None:
        return "off"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def help_with_default(text: str, target: str, field: str) -> str:
    """``text`` ending in the default, unless it states it already."""
    return text if "default" in text else f"{text} (default {default_text(target, field)})"
