"""Compile grammars once: content-hash cache, shared in-flight futures, timeout, negative cache.

One `GrammarCompiler` serves one tokenizer. `compile(spec)` returns a Future that resolves
to a `CompiledEntry` (with the grammar id step-channel descriptors name) or raises
`CompileError` carrying a gRPC status name and a user-facing message. The compile itself
runs in a thread pool, so neither the gRPC handlers nor the step loops wait on it except
through the future.

Bounded end to end: at most `num_compile_threads + max_queued_compiles` new grammars are
compiling or waiting at once (beyond: RESOURCE_EXHAUSTED at once), and the compile timeout
counts from acceptance, the wait for a worker included; a compile the wait left less than half
of it is refused for capacity, not remembered as too complex. With a `CompileSandbox` (the
service's default) each new grammar is compiled in a worker process first
(grammar_service/sandbox.py) and a worker past the timeout is killed, which frees it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from grammar_contract.report import UnenforcedKeyword
from grammar_contract.spec import GrammarSpec
from grammar_service import metrics
from grammar_service.backend_choice import compile_with
from grammar_service.backends import resolve_backend_name
from grammar_service.backends.base import GrammarBackend, GrammarCompileError
from grammar_service.config import GrammarServiceConfig
from grammar_service.restrictions import json_restrictions
from grammar_service.sandbox import CompileSandbox, SandboxError
from grammar_service.schema_drafts import as_drafted

log = logging.getLogger(__name__)


class CompileError(Exception):
    """A compile the user caused to fail; `status` is a grpc.StatusCode name."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class CompiledEntry:
    grammar_id: int
    backend: str
    compiled: Any                     # backend-specific compiled grammar
    compile_ms: float
    unenforced: tuple[UnenforcedKeyword, ...]
    restricted: tuple[UnenforcedKeyword, ...] = ()  # valid forms the grammar refuses (restrictions.py)
    fallback_from: str = ""           # `auto`'s pick, when `backend` compiled in its place


@dataclass(frozen=True)
class CompileOutcome:
    entry: CompiledEntry
    cache_hit: bool


@dataclass
class CompileStats:
    num_compiles: int = 0
    num_cache_hits: int = 0
    num_errors: int = 0
    num_timeouts: int = 0


def spec_key(spec: GrammarSpec, backend: str) -> str:
    """Content hash of what changes the compiled grammar (strict does not: it is checked apart)."""
    parts = [spec.kind, spec.text, list(spec.choices), spec.any_whitespace, spec.max_whitespace, backend]
    if spec.single_line:  # keys of the other layouts stay as they were (persisted caches)
        parts.append("single_line")
    if spec.reasoning is not None:  # (keys of grammars without a span stay what they were)
        parts.append(dataclasses.astuple(spec.reasoning))
    blob = json.dumps(parts, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def spec_bytes(spec: GrammarSpec) -> int:
    return len(spec.text.encode("utf-8")) + sum(len(c.encode("utf-8")) for c in spec.choices)


@dataclass
class _Negative:
    error: CompileError
    expires_at: float


class GrammarCompiler:
    """Cache + pool in front of the backends of one tokenizer."""

    def __init__(self, backends: Callable[[str], GrammarBackend], config: GrammarServiceConfig,
                 clock: Callable[[], float] = time.monotonic, sandbox: CompileSandbox | None = None,
                 on_reuse: Callable[[str, GrammarSpec], None] = lambda key, spec: None):
        """`sandbox`: compile workers that try each new grammar first; None compiles in this
        process only (a timed-out compile then runs on in its thread, counted until it ends).
        `on_reuse(key, spec)`: called at each cache hit (shared_grammars.py records the first)."""
        self._on_reuse = on_reuse
        self._backend_for = backends        # backend name -> GrammarBackend (built lazily)
        self._config = config
        self._clock = clock
        self._sandbox = sandbox
        self._max_jobs = config.num_compile_threads + config.max_queued_compiles
        self._num_jobs = 0                  # compiles running or waiting for a worker
        self._threads = threading.BoundedSemaphore(config.num_compile_threads)  # in-process compiles
        # one thread per accepted compile: a waiting compile waits on a worker, not a thread
        self._pool = ThreadPoolExecutor(self._max_jobs, thread_name_prefix="compile")
        self._lock = threading.Lock()
        self._by_key: OrderedDict[str, CompiledEntry] = OrderedDict()
        self._by_id: dict[int, CompiledEntry] = {}
        self._in_flight: dict[str, Future] = {}
        self._negative: dict[str, _Negative] = {}
        # Ids start at a random point so that an id from before a restart of grammar_service
        # names no grammar in the new process (ERR_UNKNOWN_GRAMMAR, never the wrong grammar).
        # They stay below 2**31: descriptors carry them as int32.
        self._next_id = secrets.randbelow(1 << 30) + 1
        self.stats = CompileStats()

    # ---- public --------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> Future:
        """Future[CompileOutcome]; raises CompileError through the future.

        The cache key names the requested backend ("auto" included), so `auto`'s choice is
        made once per spec, in the compile pool. `strict` is applied to each caller's
        outcome (cached or not): it changes the answer, not the grammar.
        """
        try:
            requested = "auto" if spec.backend in ("", "auto") else resolve_backend_name(spec.backend)
            self._check_size(spec)
        except (ValueError, CompileError) as exc:
            return _failed(exc if isinstance(exc, CompileError) else CompileError("INVALID_ARGUMENT", str(exc)))
        key = spec_key(spec, requested)
        with self._lock:
            entry = self._by_key.get(key)
            if entry is not None:
                self._by_key.move_to_end(key)
                self.stats.num_cache_hits += 1
            else:
                shared, start = self._claim(key, requested)
        if entry is not None:
            metrics.COMPILE_REQUESTS.labels("cache_hit", requested).inc()
            self._on_reuse(key, spec)
            return self._apply_strict(spec, _done(CompileOutcome(entry, cache_hit=True)))
        if start:
            self._start(key, spec, requested, shared)
        return self._apply_strict(spec, shared)

    def _claim(self, key: str, requested: str) -> tuple[Future, bool]:
        """(the future of `key`'s compile, whether the caller starts it); under the lock."""
        if (negative := self._negative.get(key)) is not None:
            if negative.expires_at > self._clock():
                return _failed(negative.error), False
            del self._negative[key]
        shared = self._in_flight.get(key)
        if shared is not None:
            return shared, False
        if self._num_jobs >= self._max_jobs:
            metrics.COMPILE_REQUESTS.labels("saturated", requested).inc()
            return _failed(CompileError("RESOURCE_EXHAUSTED", (
                f"the grammar compiler is saturated: {self._num_jobs} new grammars are compiling or "
                f"waiting (num_compile_threads {self._config.num_compile_threads} + max_queued_compiles "
                f"{self._config.max_queued_compiles}); retry later"))), False
        shared = self._in_flight[key] = Future()
        self._num_jobs += 1
        return shared, True

    def get(self, grammar_id: int) -> CompiledEntry | None:
        with self._lock:
            return self._by_id.get(grammar_id)

    def is_cached(self, key: str) -> bool:
        """A grammar of this cache key (`spec_key`) is compiled here, or compiling."""
        with self._lock:
            return key in self._by_key or key in self._in_flight

    @property
    def num_cached(self) -> int:
        return len(self._by_key)

    @property
    def num_negative(self) -> int:
        now = self._clock()
        return sum(1 for n in list(self._negative.values()) if n.expires_at > now)

    def wait_ready(self, timeout_s: float) -> bool:
        return self._sandbox is None or self._sandbox.wait_ready(timeout_s)

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals -----------------------------------------------------------------------
    def _check_size(self, spec: GrammarSpec) -> None:
        size, limit = spec_bytes(spec), self._config.max_grammar_bytes
        if size > limit:
            raise CompileError("INVALID_ARGUMENT", f"grammar text is {size} bytes, over the "
                               f"limit of {limit} bytes (max_grammar_bytes)")

    @staticmethod
    def _apply_strict(spec: GrammarSpec, outcome: Future) -> Future:
        """A future of `outcome` that fails under `strict` when the grammar leaves keywords out."""
        if not spec.strict:
            return outcome
        result: Future = Future()

        def check(done: Future) -> None:
            if (exc := done.exception()) is not None:
                result.set_exception(exc)
            elif unenforced := done.result().entry.unenforced:
                listed = "; ".join(f"{u.keyword} at {u.pointer or '/'} ({u.reason})" for u in unenforced)
                result.set_exception(CompileError("INVALID_ARGUMENT", "strict: the schema uses keywords "
                                                  f"the grammar cannot enforce: {listed}"))
            else:
                result.set_result(done.result())

        outcome.add_done_callback(check)
        return result

    def _start(self, key: str, spec: GrammarSpec, requested: str, result: Future) -> None:
        deadline = time.monotonic() + self._config.compile_timeout_s  # the wait for a worker counts
        timers: list[threading.Timer] = []

        def run() -> tuple[float, str, Any, tuple, tuple, str]:
            if self._sandbox is not None:
                probe = self._sandbox.probe(spec, requested, deadline)
                started = time.perf_counter()
                compiled = self._backend_for(probe.backend).compile(spec)
                return (probe.compile_ms + (time.perf_counter() - started) * 1e3, probe.backend, compiled,
                        probe.unenforced, restricted(probe.backend), probe.fallback_from)
            if not self._threads.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise SandboxError("RESOURCE_EXHAUSTED", "no compile thread became free before the compile timeout "
                                   "(every thread is busy with other grammars); retry later", is_grammar_fault=False)
            # what the wait left of the timeout is the compile's
            began = time.monotonic()
            timer = threading.Timer(max(0.0, deadline - began),
                                    lambda: self._on_timeout(key, requested, spec, result, time.monotonic() - began))
            timer.daemon = True
            timers.append(timer)
            timer.start()
            abandoned = None
            try:
                started = time.perf_counter()
                done = compile_with(spec, requested, self._backend_for, time_box_s=self._config.auto_time_box_s,
                                    deadline=deadline)
                abandoned = done.abandoned
                return ((time.perf_counter() - started) * 1e3, done.backend, done.grammar, done.unenforced,
                        restricted(done.backend), done.fallback_from)
            finally:
                if abandoned is None:
                    self._threads.release()
                else:  # auto's time-boxed compile runs on: it keeps its thread's place until it ends
                    abandoned.add_done_callback(lambda _: self._threads.release())

        def restricted(backend: str) -> tuple[UnenforcedKeyword, ...]:
            return json_restrictions(as_drafted(spec.text), backend) if spec.kind == "json_schema" else ()

        def finished(done: Future) -> None:
            with self._lock:
                self._num_jobs -= 1
            for timer in timers:
                timer.cancel()
            if done.cancelled():  # the pool was shut down before it ran
                self._fail(key, requested, CompileError("UNAVAILABLE", "grammar_service is shutting down"), result,
                           remember=False)
                return
            exc = done.exception()
            if exc is None:
                elapsed_ms, backend, compiled, unenforced, restricted_forms, fallback_from = done.result()
                metrics.COMPILE_SECONDS.labels(spec.kind).observe(elapsed_ms / 1e3)
                if fallback_from:
                    metrics.BACKEND_FALLBACKS.labels(fallback_from, backend).inc()
                self._store(key, requested, CompiledEntry(0, backend, compiled, elapsed_ms, unenforced,
                                                          restricted_forms, fallback_from), result)
            elif isinstance(exc, SandboxError) and exc.timed_out:
                self._on_timeout(key, requested, spec, result, exc.compile_s)
            elif isinstance(exc, SandboxError):
                if exc.is_grammar_fault:
                    log.warning("compile of %s grammar %s failed in its worker: %s", spec.kind, key[:16], exc.message)
                self._fail(key, requested, CompileError(exc.status, exc.message), result,
                           remember=exc.is_grammar_fault)
            elif isinstance(exc, (GrammarCompileError, ValueError)):
                self._fail(key, requested, CompileError("INVALID_ARGUMENT", str(exc)), result)
            elif isinstance(exc, RecursionError):
                self._fail(key, requested, CompileError("INVALID_ARGUMENT", f"{spec.kind}: the grammar nests "
                                                        "too deeply to compile"), result)
            else:
                log.error("compile of %s grammar %s failed unexpectedly", spec.kind, key[:16], exc_info=exc)
                self._fail(key, requested, CompileError("INTERNAL", f"compile failed: {exc!r}"), result)

        self._pool.submit(run).add_done_callback(finished)

    def _store(self, key, requested: str, compiled: CompiledEntry, result: Future) -> None:
        """Caches `compiled` under the next grammar id (its own id is a placeholder)."""
        with self._lock:
            if self._in_flight.get(key) is not result:
                return  # timed out meanwhile: the negative entry stands until it expires
            del self._in_flight[key]
            entry = dataclasses.replace(compiled, grammar_id=self._next_id)
            self._next_id += 1
            self._by_key[key] = entry
            self._by_id[entry.grammar_id] = entry
            while len(self._by_key) > self._config.max_cached_grammars:
                _, old = self._by_key.popitem(last=False)
                del self._by_id[old.grammar_id]
            self.stats.num_compiles += 1
        metrics.COMPILE_REQUESTS.labels("compiled", requested).inc()
        result.set_result(CompileOutcome(entry, cache_hit=False))

    def _fail(self, key: str, requested: str, error: CompileError, result: Future, *, timed_out: bool = False,
              remember: bool = True) -> None:
        """`remember`: the grammar itself failed, so the same spec is refused from memory for the
        TTL; a compile that failed for capacity or shutdown is not remembered."""
        with self._lock:
            if self._in_flight.get(key) is not result:
                return
            del self._in_flight[key]
            if remember:
                self._negative[key] = _Negative(error, self._clock() + self._config.negative_cache_ttl_s)
            self.stats.num_errors += 1
            self.stats.num_timeouts += timed_out
        metrics.COMPILE_REQUESTS.labels("timeout" if timed_out else "error", requested).inc()
        result.set_exception(error)

    def _on_timeout(self, key: str, requested: str, spec: GrammarSpec, result: Future, compile_s: float) -> None:
        """`compile_s`: the part of the timeout the grammar compiled; the rest it waited for a worker."""
        limit = self._config.compile_timeout_s
        if compile_s < limit / 2:  # the queue took most of its time: not shown to be the grammar's fault
            self._fail(key, requested, CompileError("RESOURCE_EXHAUSTED", (
                f"the compile did not finish within the {limit:g} s compile timeout, {limit - compile_s:.1f} s of "
                "which it waited for a worker busy with other grammars; retry later")), result, timed_out=True,
                remember=False)
            return
        log.warning("compile of %s grammar %s (%d bytes) did not finish within %g s", spec.kind, key[:16],
                    spec_bytes(spec), limit)
        # In-process, the backend thread cannot be interrupted: it finishes in the background and
        # its result is dropped. In a sandbox its worker was killed. The spec is answered from
        # the negative cache meanwhile.
        self._fail(key, requested, CompileError("INVALID_ARGUMENT", f"grammar compile did not finish within "
                                     f"the {limit:g} s compile timeout (the grammar is too complex)"),
                   result, timed_out=True)


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _failed(exc: BaseException) -> Future:
    f: Future = Future()
    f.set_exception(exc)
    return f
