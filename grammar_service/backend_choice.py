"""Which backend compiles a spec: the one asked for, or `auto`'s pick with fallbacks.

`auto` never waits long on a compile it can do without: when its pick is slower to compile
than a fallback that is known to compile the schema (llguidance checks that in ms, before any
compile), the pick's compile gets a time box (`auto_time_box_s`; at most what the compile
timeout leaves once `FALLBACK_RESERVE_S` is kept for the fallback). Past it the fallback
serves, its own unenforced keywords reported. A native compile cannot be interrupted: the
boxed one runs on in its thread (`Compiled.abandoned`), which the caller accounts for (a
compile worker is replaced; an in-process compile keeps its compile thread until it ends).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

from grammar_contract.spec import GrammarSpec
from grammar_service.auto_choice import choose_backend
from grammar_service.backends import DEFAULT_BACKEND
from grammar_service.backends.base import GrammarBackend, GrammarCompileError

log = logging.getLogger(__name__)

BackendFor = Callable[[str], GrammarBackend]  # name -> backend for the served tokenizer
FALLBACK_RESERVE_S = 1.0  # of the compile timeout, kept for the fast fallback (ms; lanes: up to ~0.5 s)


@dataclass(frozen=True)
class Compiled:
    backend: str
    grammar: Any                      # the backend's compiled grammar
    unenforced: tuple                 # UnenforcedKeyword entries of that backend
    abandoned: Future | None = None   # a time-boxed compile that ran past its box, still running


def compile_with(spec: GrammarSpec, requested: str, backend_for: BackendFor, *, time_box_s: float = 0.0,
                 deadline: float | None = None) -> Compiled:
    """Compile `spec` (slow; runs in the compile pool or a compile worker).

    `requested` is a backend name or "auto". A failed compile falls back to the next backend
    in `auto`'s order; when all fail, the first backend's error is raised. `deadline`
    (time.monotonic()) is the compile timeout's; `time_box_s` > 0 caps `auto`'s wait on a slow
    pick that a fast fallback can replace (module doc), 0 waits up to the deadline's reserve.
    """
    if requested != "auto":
        order, known, boxed = (requested,), {}, ""
    else:
        order, known, boxed = auto_plan(spec, backend_for)
    first_error: GrammarCompileError | None = None
    abandoned: Future | None = None
    for name in order:
        try:
            backend = backend_for(name)
        except ValueError:  # a fallback that is not installed here
            continue
        try:
            if name == boxed and (box := _box_s(time_box_s, deadline)) is not None:
                grammar, abandoned = _compile_within(backend, spec, box)
                if grammar is None:
                    log.info("auto: the %s compile of a %s grammar (%d bytes) ran past its %.2f s time box; "
                             "the next backend serves it", name, spec.kind, len(spec.text), box)
                    continue
            else:
                grammar = backend.compile(spec)
        except GrammarCompileError as exc:
            first_error = first_error or exc
            continue
        unenforced = known[name] if name in known else backend.unenforced_keywords(spec)
        return Compiled(name, grammar, tuple(unenforced), abandoned)
    if abandoned is not None:  # no fallback compiled after all: the boxed compile it is, however long
        return Compiled(boxed, abandoned.result(), tuple(known.get(boxed, ())))  # raises its error, if any
    raise first_error or GrammarCompileError(f"no grammar backend could compile this {spec.kind}")


def _box_s(time_box_s: float, deadline: float | None) -> float | None:
    """Seconds the boxed compile may take; None: no box (no deadline and no time box)."""
    left = None if deadline is None else max(0.0, deadline - time.monotonic() - FALLBACK_RESERVE_S)
    if time_box_s > 0:
        return time_box_s if left is None else min(time_box_s, left)
    return left


def _compile_within(backend: GrammarBackend, spec: GrammarSpec, box_s: float) -> tuple[Any, Future | None]:
    """(grammar, None) when the compile finished within box_s; (None, its future) when not."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(backend.compile(spec))
        except BaseException as exc:  # noqa: BLE001 -- handed to whoever reads the future
            future.set_exception(exc)

    threading.Thread(target=run, name=f"{backend.name}-boxed-compile", daemon=True).start()
    try:
        return future.result(timeout=box_s), None
    except FutureTimeout:
        return None, future


def auto_plan(spec: GrammarSpec, backend_for: BackendFor) -> tuple[tuple[str, ...], dict[str, tuple], str]:
    """Backends to try for `auto`, best first, the unenforced keywords already known, and the
    backend whose compile is time-boxed ("" for none).

    The order is grammar_service.auto_choice.choose_backend's, unchanged (issue 8's rule: the
    backend that enforces more of the schema, then the one that compiles faster); the
    trade-off against mask-fill speed is in docs/guarantees.md.
    """
    choice = choose_backend(spec, backend_for, DEFAULT_BACKEND)
    boxed = choice.backend if choice.fast_fallback else ""
    return (choice.backend, *choice.fallbacks), {choice.backend: choice.unenforced}, boxed


def auto_order(spec: GrammarSpec, backend_for: BackendFor) -> tuple[tuple[str, ...], dict[str, tuple]]:
    """auto_plan without the time box: the order and the known unenforced keywords."""
    order, known, _ = auto_plan(spec, backend_for)
    return order, known
