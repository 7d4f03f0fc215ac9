"""Grammar backends by name; each is imported only when first asked for.

A backend registers here as "name": "module:Class"; the class subclasses
`grammar_service.backends.base.GrammarBackend`. "auto" means DEFAULT_BACKEND.
"""
from __future__ import annotations

import importlib

DEFAULT_BACKEND = "xgrammar"
_REGISTRY: dict[str, str] = {
    "xgrammar": "grammar_service.backends.xgrammar:XGrammarBackend",
    "llguidance": "grammar_service.backends.llguidance:LLGuidanceBackend",
}


def available_backends() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def resolve_backend_name(name: str) -> str:
    """"" and "auto" -> the default; an unknown name raises ValueError listing the known ones."""
    name = name or "auto"
    if name == "auto":
        return DEFAULT_BACKEND
    if name not in _REGISTRY:
        raise ValueError(f"unknown grammar backend {name!r}; expected one of {('auto', *_REGISTRY)}")
    return name


def load_backend_class(name: str) -> type:
    """Import and return the backend class for `name` (after resolve_backend_name)."""
    module_name, class_name = _REGISTRY[resolve_backend_name(name)].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"grammar backend {name!r} is not installed here ({exc})") from exc
    return getattr(module, class_name)
