"""Which backend compiles a spec: the one asked for, or `auto`'s pick with fallbacks.

`auto` never waits long on a compile it can do without. When its pick is slower to compile
than a fallback known to compile the schema (llguidance checks that in ms, before any
compile), the fast fallback compiles first, and the pick gets what is left of `auto`'s
budget (`auto_time_box_s`, counted from the start, the analysis included; at most what the
compile timeout leaves). A pick that finishes within it serves; past it, or when nothing is
left (the fallback took the budget: the pick cannot win), the fallback serves at once, its
own unenforced keywords reported. When the pick is itself the faster compiler, a timeout falls
back as an error does: the pick gets `PICK_SHARE` of the time to the compile deadline, and past
it the next backend compiles in the rest (should that one fail, the pick may still finish). A
native compile cannot be interrupted: the boxed one runs on in its thread
(`Compiled.abandoned`), which the caller accounts for (a compile worker is replaced; an
in-process compile keeps its compile thread until it ends).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

from grammar_contract.spec import GrammarSpec
from grammar_service.auto_choice import AUTO_CANDIDATES, choose_backend
from grammar_service.backends import DEFAULT_BACKEND
from grammar_service.backends.base import GrammarBackend, GrammarCompileError
from grammar_service.schema_check import check_schema

log = logging.getLogger(__name__)

BackendFor = Callable[[str], GrammarBackend]  # name -> backend for the served tokenizer

# The pick that compiles fastest and still runs at half the compile timeout has run away
# (llguidance compiles every schema of the schema_truth corpus in about 1 s at most, of 10): the
# other half is the fallback's.
PICK_SHARE = 0.5
# A fallback compile stops this long before the compile deadline, so that its answer (and the
# reasons of every backend) reaches grammar_service before the worker is killed there.
DEADLINE_MARGIN_S = 0.5


@dataclass(frozen=True)
class Compiled:
    backend: str
    grammar: Any                      # the backend's compiled grammar
    unenforced: tuple                 # UnenforcedKeyword entries of that backend
    abandoned: Future | None = None   # a time-boxed compile that ran past its box, still running
    fallback_from: str = ""           # `auto`'s pick when another backend serves in its place


def compile_with(spec: GrammarSpec, requested: str, backend_for: BackendFor, *, time_box_s: float = 0.0,
                 deadline: float | None = None) -> Compiled:
    """Compile `spec` (slow; runs in the compile pool or a compile worker).

    `requested` is a backend name or "auto". A failed compile falls back to the next backend
    in `auto`'s order; when all fail, the first backend's error is raised. `deadline`
    (time.monotonic()) is the compile timeout's; `time_box_s` > 0 is `auto`'s budget on a slow
    pick that a fast fallback can replace (module doc), 0: up to the deadline. Under `auto`, a
    pick with only slower fallbacks gets `PICK_SHARE` of the time to the deadline.
    """
    started = time.monotonic()
    if spec.kind == "json_schema":
        check_schema(spec.text)  # before any analysis or backend reads a malformed schema
    if requested != "auto":
        order, known, fast = (requested,), {}, ""
    else:
        order, known, fast = auto_plan(spec, backend_for)
    if fast and (budget_end := _budget_end(started, time_box_s, deadline)) is not None:
        if (done := _compile_boxed(spec, order[0], fast, backend_for, known, budget_end)) is not None:
            return done
        order = (order[0],)  # the fast fallback failed after all: the pick alone, up to the deadline
    elif requested == "auto" and len(order) > 1 and deadline is not None:
        return _compile_or_fall_back(spec, order, backend_for, known, deadline)
    return _first_compiled(spec, order, backend_for, known)


def compile_serving(spec: GrammarSpec, requested: str, backend_for: BackendFor, unusable: Callable[[str, Any], str],
                    *, time_box_s: float = 0.0, deadline: float | None = None) -> Compiled:
    """`compile_with`, then `unusable(backend, grammar)`: why a compiled grammar cannot serve
    ("" when it can; a backend limit met at the first token, as llguidance's parser row limit on
    hundreds of optional properties). Under `auto` the other backends then compile, each within
    what the deadline leaves; when none serves, one GrammarCompileError names each
    backend's reason. A fallback compile left running past the deadline is `abandoned` on the
    error (`UnservedGrammar`)."""
    done = compile_with(spec, requested, backend_for, time_box_s=time_box_s, deadline=deadline)
    if not (reason := unusable(done.backend, done.grammar)):
        return done
    if requested != "auto":
        raise GrammarCompileError(f"{spec.kind}: {reason}; simplify the grammar or try the other backend")
    reasons, running = [f"{done.backend}: {reason}"], done.abandoned
    for name in (n for n in AUTO_CANDIDATES if n != done.backend):
        try:
            backend = backend_for(name)
        except ValueError:  # not installed here
            continue
        left_s = None if deadline is None else deadline - time.monotonic() - DEADLINE_MARGIN_S
        try:
            grammar, late = ((backend.compile(spec), None) if left_s is None
                             else _compile_within(backend, spec, max(0.0, left_s)))
        except GrammarCompileError as exc:
            reasons.append(f"{name}: {exc}")
            continue
        running = running or late
        if grammar is None:
            reasons.append(f"{name}: did not compile within the {max(0.0, left_s):.1f} s the compile timeout left")
        elif not (why := unusable(name, grammar)):
            log.info("auto: %s cannot serve a %s grammar (%s); %s serves it", done.backend, spec.kind, reason, name)
            return Compiled(name, grammar, tuple(backend.unenforced_keywords(spec)), abandoned=running,
                            fallback_from=done.backend)
        else:
            reasons.append(f"{name}: {why}")
    raise UnservedGrammar(f"{spec.kind}: no grammar backend can serve it: " + "; ".join(reasons), running)


class UnservedGrammar(GrammarCompileError):
    """No backend serves the grammar; `abandoned`: a compile still running in this process."""

    def __init__(self, message: str, abandoned: Future | None = None) -> None:
        super().__init__(message)
        self.abandoned = abandoned


def _first_compiled(spec: GrammarSpec, order: tuple[str, ...], backend_for: BackendFor, known: dict,
                    first_error: GrammarCompileError | None = None) -> Compiled:
    """The first backend of `order` that compiles `spec`; the first error when none does."""
    for name in order:
        try:
            backend = backend_for(name)
        except ValueError:  # a fallback that is not installed here
            continue
        try:
            grammar = backend.compile(spec)
        except GrammarCompileError as exc:
            first_error = first_error or exc
            continue
        unenforced = known[name] if name in known else backend.unenforced_keywords(spec)
        return Compiled(name, grammar, tuple(unenforced), fallback_from="" if name == order[0] else order[0])
    raise first_error or GrammarCompileError(f"no grammar backend could compile this {spec.kind}")


def _compile_or_fall_back(spec: GrammarSpec, order: tuple[str, ...], backend_for: BackendFor, known: dict,
                          deadline: float) -> Compiled:
    """The pick within its share of the time to `deadline`; past it, or failing, the fallbacks."""
    pick, fallbacks = order[0], order[1:]
    try:
        backend = backend_for(pick)
    except ValueError:  # not installed here
        return _first_compiled(spec, fallbacks, backend_for, known)
    share_s = max(0.0, deadline - time.monotonic()) * PICK_SHARE
    try:
        grammar, running = _compile_within(backend, spec, share_s)
    except GrammarCompileError as exc:
        return dataclasses.replace(_first_compiled(spec, fallbacks, backend_for, known, exc), fallback_from=pick)
    if grammar is not None:
        return Compiled(pick, grammar, tuple(known[pick]))
    log.info("auto: the %s compile of a %s grammar (%d bytes) ran past %.2f s, its share of the compile "
             "timeout; the next backend compiles", pick, spec.kind, len(spec.text), share_s)
    try:
        return dataclasses.replace(_first_compiled(spec, fallbacks, backend_for, known), abandoned=running,
                                   fallback_from=pick)
    except GrammarCompileError:  # no fallback compiles it: the pick may still finish by the deadline
        return Compiled(pick, running.result(), tuple(known[pick]))


def _budget_end(started: float, time_box_s: float, deadline: float | None) -> float | None:
    """When `auto`'s budget for a boxed pick ends (time.monotonic()); None: no box at all."""
    if time_box_s > 0:
        return started + time_box_s if deadline is None else min(started + time_box_s, deadline)
    return deadline


def _compile_boxed(spec: GrammarSpec, pick: str, fast: str, backend_for: BackendFor, known: dict,
                   budget_end: float) -> Compiled | None:
    """The fast fallback first, then the pick within what is left of the budget; None when the
    fallback does not compile after all."""
    try:
        fallback = backend_for(fast)
        fallback_grammar = fallback.compile(spec)
    except (ValueError, GrammarCompileError):  # not installed, or its analysis was wrong: the pick alone
        return None
    served = Compiled(fast, fallback_grammar, tuple(fallback.unenforced_keywords(spec)), fallback_from=pick)
    if (box := budget_end - time.monotonic()) <= 0:  # the pick cannot finish within the budget
        log.info("auto: %s took %s's budget for a %s grammar (%d bytes); it serves", fast, pick, spec.kind,
                 len(spec.text))
        return served
    try:
        grammar, abandoned = _compile_within(backend_for(pick), spec, box)
    except (GrammarCompileError, ValueError):
        return served
    if grammar is None:
        log.info("auto: the %s compile of a %s grammar (%d bytes) ran past its %.2f s time box; %s serves",
                 pick, spec.kind, len(spec.text), box, fast)
        return dataclasses.replace(served, abandoned=abandoned)
    return Compiled(pick, grammar, tuple(known[pick]))


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
    fast fallback that compiles before the pick, whose compile is then time-boxed ("" for none).

    The order is grammar_service.auto_choice.choose_backend's, unchanged (the rule: the
    backend that enforces more of the schema, then the one that compiles faster); the
    trade-off against mask-fill speed is in docs/guarantees.md.
    """
    choice = choose_backend(spec, backend_for, DEFAULT_BACKEND)
    return (choice.backend, *choice.fallbacks), {choice.backend: choice.unenforced}, choice.fast_fallback


def auto_order(spec: GrammarSpec, backend_for: BackendFor) -> tuple[tuple[str, ...], dict[str, tuple]]:
    """auto_plan without the time box: the order and the known unenforced keywords."""
    order, known, _ = auto_plan(spec, backend_for)
    return order, known
