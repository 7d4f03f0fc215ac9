"""The inside of a compile worker process (grammar_service/sandbox.py starts it).

A worker loads the served tokenizer, builds the backends, caps its own address space and
then compiles one spec at a time, answering over its pipe:
`("ready",)` once, then per `(spec, requested, deadline)` request
`("ok", backend, unenforced, compile_ms, must_replace, fallback_from)` or `("error", status,
message[, must_replace])`; `must_replace`: a compile that `auto` left past its time box (or its
deadline, falling back) still runs in this process, which the parent then replaces. Whatever a grammar does in here (a native crash, runaway
memory, runaway time) ends this process only; the parent kills it on its deadline.

It runs the same `compile_with` as grammar_service, so `auto` chooses the same backend, and
checks that the grammar accepts some string (grammar_service/emptiness.py).
"""
from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import time
import traceback

import numpy as np

from grammar_contract.spec import GrammarSpec
from grammar_service.backend_choice import UnservedGrammar, compile_serving
from grammar_service.backends import available_backends, load_backend_class, resolve_backend_name
from grammar_service.backends.base import GrammarCompileError
from grammar_service.emptiness import empty_language_reason
from grammar_service.tokenizer import load_tokenizer
from structgen.json_limits import JsonDepthError, loads_limited

WORKER_NICENESS = 5


def _lower_priority() -> None:
    """A slow compile here yields the CPUs to the serving path (the engine, the step loops). Set
    once the worker is built, so that a standby's start-up is not the one that waits; niceness
    is per thread on Linux, so every thread (the backends' pools) is set."""
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else (0,):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), WORKER_NICENESS)
        except OSError:  # a thread that ended meanwhile
            pass


def _cap_memory(max_compile_memory_mb: int) -> None:
    """Address space limited to what the loaded worker uses now plus the compile budget."""
    if max_compile_memory_mb <= 0:
        return
    with open("/proc/self/statm") as statm:
        current = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = current + max_compile_memory_mb * (1 << 20)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


class _Backends:
    """name -> backend for the worker's tokenizer, built on first use (as GrammarService does)."""

    def __init__(self, tokenizer, backend_kwargs: dict):
        self._tokenizer, self._kwargs, self._built = tokenizer, backend_kwargs, {}

    def __call__(self, name: str):
        name = resolve_backend_name(name)
        if name not in self._built:
            self._built[name] = load_backend_class(name)(self._tokenizer, **self._kwargs)
        return self._built[name]


def first_step_reason(backend, compiled) -> str:
    """Why a fresh matcher cannot take the first token its own mask allows ("" when it can):
    a backend limit met at once (llguidance: "parser too complex" on a 5,000-way alternative)
    would otherwise fail the request at its first decode step."""
    matcher = backend.new_matcher(compiled)
    masks = np.zeros((1, backend.tokenizer.mask_words), dtype=np.int32)
    backend.batch_fill([matcher], masks, [0])
    allowed = np.flatnonzero(np.unpackbits(masks.view(np.uint8), bitorder="little"))
    if len(allowed) == 0 or backend.batch_accept([matcher], [int(allowed[0])])[0]:
        return ""  # an empty first mask is emptiness's to explain (or a grammar of only EOS)
    inner = getattr(matcher, "inner", None)
    detail = inner.get_error().splitlines()[0] if hasattr(inner, "get_error") and inner.get_error() else ""
    return f"the {backend.name} matcher refuses the first token its own mask allows" + (f" ({detail})" if detail else "")


def _check_depth(spec: GrammarSpec) -> None:
    """JsonDepthError past MAX_JSON_DEPTH (the walkers after it recurse per level); malformed
    JSON is left to the backend, whose message names the syntax error."""
    try:
        loads_limited(spec.text, spec.kind)
    except JsonDepthError:
        raise
    except ValueError:
        pass


def _is_out_of_memory(exc: Exception) -> bool:
    """The address-space cap met: as MemoryError, or as a thread (its stack) the backend could not start."""
    return (isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM)
            or (isinstance(exc, RuntimeError) and "can't start new thread" in str(exc)))


def compile_one(spec: GrammarSpec, requested: str, backends: _Backends, *, time_box_s: float = 0.0,
                deadline: float | None = None) -> tuple:
    started = time.perf_counter()
    try:
        if spec.kind in ("json_schema", "structural_tag"):
            _check_depth(spec)
        done = compile_serving(spec, requested, backends, lambda name, grammar: first_step_reason(backends(name), grammar),
                               time_box_s=time_box_s, deadline=deadline)
        name, compiled, unenforced = done.backend, done.grammar, done.unenforced
        reason = empty_language_reason(spec, name, compiled)
    except UnservedGrammar as exc:  # a fallback compile may still run here: the parent replaces us
        return ("error", "INVALID_ARGUMENT", str(exc), exc.abandoned is not None)
    except (GrammarCompileError, ValueError) as exc:
        return ("error", "INVALID_ARGUMENT", str(exc))
    except RecursionError:
        return ("error", "INVALID_ARGUMENT", f"{spec.kind}: the grammar nests too deeply to compile")
    except Exception as exc:  # noqa: BLE001 (answered: the worker lives on)
        if _is_out_of_memory(exc):
            return ("error", "INVALID_ARGUMENT", f"{spec.kind}: compiling the grammar needs more memory than "
                    "the compile memory limit (max_compile_memory_mb)")
        traceback.print_exc()  # a bug of ours on this grammar
        return ("error", "INTERNAL", f"{spec.kind}: the compile failed on an internal error ({exc!r})")
    if reason:
        return ("error", "INVALID_ARGUMENT", f"{spec.kind}: {reason}")
    return ("ok", name, tuple(unenforced), (time.perf_counter() - started) * 1e3, done.abandoned is not None,
            done.fallback_from)


def worker_main(conn, tokenizer_dir: str, vocab_size: int, backend_kwargs: dict, max_compile_memory_mb: int,
                auto_time_box_s: float = 0.0) -> None:
    """Started by grammar_service/forker.py (which makes it die with the forker, and the forker
    with grammar_service); the tokenizer is the one the forker inherited when it is the same."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches grammar_service, which stops us
    tokenizer, _ = load_tokenizer(tokenizer_dir, vocab_size)
    backends = _Backends(tokenizer, backend_kwargs)
    for name in available_backends():  # before "ready": a first use would count against a compile's timeout
        try:
            backends(name)
        except ValueError:  # not installed here
            pass
    _lower_priority()
    _cap_memory(max_compile_memory_mb)
    try:
        conn.send(("ready",))
        while True:
            spec, requested, deadline = conn.recv()
            conn.send(compile_one(spec, requested, backends, time_box_s=auto_time_box_s, deadline=deadline))
    except (EOFError, OSError):  # grammar_service closed the pipe: its end is ours
        os._exit(0)
