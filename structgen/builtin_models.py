"""Names of the models structgen brings along, each resolved to local files on first use
(no torch here: the command line lists them without loading anything).

    default / smollm2-135m-instruct   SmolLM2-135M-Instruct, GGUF Q4_1 (generation_service/model/default_model.py)
    tiny-random                       4 random layers, a real 32k tokenizer (model/tiny_random_model.py),
                                      for fast tests and CPU benchmarks
"""

from __future__ import annotations

import pathlib
from typing import Callable


def _default() -> pathlib.Path:
    from generation_service.model.default_model import ensure_default_model
    return ensure_default_model()


def _tiny_random() -> pathlib.Path:
    from generation_service.model.tiny_random_model import ensure_tiny_random_model
    return ensure_tiny_random_model()


BUILTIN_MODELS: dict[str, Callable[[], pathlib.Path]] = {
    "default": _default,
    "smollm2-135m-instruct": _default,
    "tiny-random": _tiny_random,
}


def resolve_builtin(source: str) -> pathlib.Path | None:
    """The local path of built-in model ``source`` (fetched or built if needed); None for other sources."""
    make = BUILTIN_MODELS.get(source)
    return None if make is None else make()
