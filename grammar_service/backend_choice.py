"""Which backend compiles a spec: the one asked for, or `auto`'s pick with fallbacks."""
from __future__ import annotations

from typing import Any, Callable

from generation_service.engine.params import GrammarSpec
from grammar_service.backends import DEFAULT_BACKEND
from grammar_service.backends.base import GrammarBackend, GrammarCompileError

BackendFor = Callable[[str], GrammarBackend]  # name -> backend for the served tokenizer


def compile_with(spec: GrammarSpec, requested: str, backend_for: BackendFor) -> tuple[str, Any, tuple]:
    """(backend name, compiled grammar, unenforced keywords); slow, runs in the compile pool.

    `requested` is a backend name or "auto". A failed compile falls back to the next backend
    in `auto`'s order; when all fail, the first backend's error is raised.
    """
    order, known = auto_order(spec, backend_for) if requested == "auto" else ((requested,), {})
    first_error: GrammarCompileError | None = None
    for name in order:
        try:
            backend = backend_for(name)
        except ValueError:  # a fallback that is not installed here
            continue
        try:
            compiled = backend.compile(spec)
        except GrammarCompileError as exc:
            first_error = first_error or exc
            continue
        unenforced = known[name] if name in known else backend.unenforced_keywords(spec)
        return name, compiled, tuple(unenforced)
    raise first_error or GrammarCompileError(f"no grammar backend could compile this {spec.kind}")


def auto_order(spec: GrammarSpec, backend_for: BackendFor) -> tuple[tuple[str, ...], dict[str, tuple]]:
    """Backends to try for `auto`, best first, and the unenforced keywords already known.

    The order is grammar_service.guarantees.choose_backend's, unchanged (issue 8's rule: the
    backend that enforces more of the schema, then the one that compiles faster); the
    trade-off against mask-fill speed is in docs/guarantees.md.
    """
    from grammar_service.guarantees import choose_backend

    choice = choose_backend(spec, backend_for, DEFAULT_BACKEND)
    return (choice.backend, *choice.fallbacks), {choice.backend: choice.unenforced}
