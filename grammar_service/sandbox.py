"""Compile each new grammar first in a worker process, so a grammar can only fail its own request.

A backend runs native code (xgrammar C++, llguidance Rust) that a grammar can crash (a deep
`$ref` chain overflows llguidance's stack), exhaust (memory) or keep busy past any timeout (a
thread cannot be interrupted). `CompileSandbox.probe` runs the whole compile in a worker
(grammar_service/sandbox_worker.py) under an address-space cap and the caller's deadline; a
worker that crashes or is killed on its deadline takes only that grammar's request with it,
and a new one takes its place. Only a grammar that compiled there within the limits is then
compiled by grammar_service itself (the compile is deterministic: same library, same input);
cached grammars never pass through a worker. The cost, a second compile of each new grammar,
is in docs/grammar_service.md, "Compile".

Workers are forked from a copy of grammar_service made before its gRPC server
(grammar_service/forker.py), with the backends imported and, when grammar_service had loaded
its tokenizer by then, the tokenizer too: a worker, first or replaced, is ready in milliseconds.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

from grammar_contract.report import UnenforcedKeyword
from grammar_service.forker import ForkedWorker, WorkerForker

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0   # a worker loads the tokenizer and builds a backend before "ready"
_RESTART_BACKOFF_S = 1.0   # after a worker failed to start


@dataclass(frozen=True)
class ProbeResult:
    backend: str                               # the backend that compiled it (auto's choice)
    unenforced: tuple[UnenforcedKeyword, ...]
    compile_ms: float
    fallback_from: str = ""                    # auto's pick, when `backend` served in its place


class SandboxError(Exception):
    """A probe that failed; `status` is a grpc.StatusCode name. `is_grammar_fault`: the grammar
    itself failed (remembered in the negative cache), not the compiler's capacity. `compile_s`:
    of a timed-out probe, the seconds it had a worker (the rest of the timeout it waited)."""

    def __init__(self, status: str, message: str, *, is_grammar_fault: bool, timed_out: bool = False,
                 compile_s: float = 0.0):
        super().__init__(message)
        self.status, self.message = status, message
        self.is_grammar_fault, self.timed_out, self.compile_s = is_grammar_fault, timed_out, compile_s


class CompileSandbox:
    """`num_workers` compile worker processes for one tokenizer; `probe` is thread-safe."""

    def __init__(self, forker: WorkerForker, tokenizer_dir: str, vocab_size: int, *, num_workers: int,
                 backend_kwargs: dict, max_compile_memory_mb: int, auto_time_box_s: float = 0.0):
        self._forker = forker
        self._args = (tokenizer_dir, vocab_size, dict(backend_kwargs), max_compile_memory_mb, auto_time_box_s)
        self._cond = threading.Condition()
        self._idle: list[ForkedWorker] = []
        self._busy: set[int] = set()   # pids of workers compiling now
        self._is_closed = False
        self._num_workers = num_workers
        self._has_started = threading.Event()  # a first worker is ready
        self.num_replaced = 0
        for _ in range(num_workers):
            self._start_worker()

    # ---- public --------------------------------------------------------------------------
    def probe(self, spec, requested: str, deadline: float) -> ProbeResult:
        """Compile `spec` in a worker by `deadline` (time.monotonic()); raises SandboxError.
        The first workers' start-up (once per tokenizer) moves the deadline: it is not the
        grammar's time; the wait for a busy worker is."""
        if not self._has_started.is_set():
            before = time.monotonic()
            self._has_started.wait(_START_TIMEOUT_S)
            deadline += time.monotonic() - before
        worker = self._acquire(deadline)
        acquired = time.monotonic()
        try:
            worker.conn.send((spec, requested, deadline))
            if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
                self._replace(worker)
                raise SandboxError("INVALID_ARGUMENT", "", is_grammar_fault=True, timed_out=True,
                                   compile_s=time.monotonic() - acquired)
            try:
                reply = worker.conn.recv()
            except (EOFError, OSError):
                raise SandboxError("INVALID_ARGUMENT", self._crash_message(worker, spec), is_grammar_fault=True) from None
        except (BrokenPipeError, OSError) as exc:  # the worker died before it read the request
            self._replace(worker)
            raise SandboxError("UNAVAILABLE", f"a compile worker failed: {exc!r}", is_grammar_fault=False) from None
        except SandboxError:
            raise
        if reply[0] == "ok" and reply[4] or reply[0] == "error" and reply[3:4] == (True,):
            self._replace(worker)  # auto's time-boxed (or fallback) compile still runs in it
        else:
            self._release(worker)
        if reply[0] == "ok":
            return ProbeResult(backend=reply[1], unenforced=tuple(reply[2]), compile_ms=reply[3], fallback_from=reply[5])
        raise SandboxError(reply[1], reply[2], is_grammar_fault=True)

    @property
    def num_idle(self) -> int:
        with self._cond:
            return len(self._idle)

    def wait_ready(self, timeout_s: float) -> bool:
        """True once every worker has started (none busy yet), False after timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._idle) + len(self._busy) < self._num_workers:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._is_closed:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self) -> None:
        self._has_started.set()  # nobody waits for a start any more
        with self._cond:
            self._is_closed = True
            workers, self._idle = self._idle, []
            self._cond.notify_all()
        for worker in workers:
            _kill(worker)

    # ---- workers -------------------------------------------------------------------------
    def _acquire(self, deadline: float) -> ForkedWorker:
        with self._cond:
            while not self._idle:
                remaining = deadline - time.monotonic()
                if self._is_closed:
                    raise SandboxError("UNAVAILABLE", "grammar_service is shutting down", is_grammar_fault=False)
                if remaining <= 0:
                    why = ("every worker is busy with other grammars" if self._busy else
                           "the compile workers are still starting")
                    raise SandboxError("RESOURCE_EXHAUSTED", f"no compile worker became free before the compile "
                                       f"timeout ({why}); retry later", is_grammar_fault=False)
                self._cond.wait(remaining)
            worker = self._idle.pop()
            self._busy.add(worker.pid)
            return worker

    def _release(self, worker: ForkedWorker) -> None:
        with self._cond:
            self._busy.discard(worker.pid)
            if self._is_closed:
                _kill(worker)
                return
            self._idle.append(worker)
            self._cond.notify()

    def _replace(self, worker: ForkedWorker) -> None:
        """Kill a worker (timed out, crashed) and start another in its place."""
        with self._cond:
            self._busy.discard(worker.pid)
        _kill(worker)
        self.num_replaced += 1
        self._start_worker()

    def _crash_message(self, worker: ForkedWorker, spec) -> str:
        worker.join(5)
        code = worker.exitcode
        self._replace(worker)
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 and
               -code in signal.Signals._value2member_map_ else f"exit code {code}")
        return (f"{spec.kind}: the grammar crashed the compiler ({how}); it may nest too deeply (e.g. a long "
                "chain of $ref) or need more than the compile memory limit (max_compile_memory_mb)")

    def _start_worker(self) -> None:
        threading.Thread(target=self._start_one, name="compile-worker-start", daemon=True).start()

    def _start_one(self) -> None:
        while True:
            with self._cond:
                if self._is_closed:
                    return
            worker = self._spawn()
            with self._cond:
                if worker is not None and not self._is_closed:
                    self._idle.append(worker)
                    self._cond.notify()
                    self._has_started.set()
                    return
            if worker is not None:  # closed meanwhile
                _kill(worker)
                return
            time.sleep(_RESTART_BACKOFF_S)

    def _spawn(self) -> ForkedWorker | None:
        from grammar_service.sandbox_worker import worker_main

        try:
            worker = self._forker.spawn(worker_main, self._args)
        except (EOFError, OSError) as exc:  # the forker is gone: grammar_service is going down
            log.error("cannot start a compile worker: %r", exc)
            return None
        try:
            if worker.conn.poll(_START_TIMEOUT_S) and worker.conn.recv() == ("ready",):
                return worker
        except (EOFError, OSError):
            pass
        if not self._is_closed:
            worker.join(1.0)
            log.error("a compile worker did not start (exit code %s)", worker.exitcode)
        _kill(worker)
        return None


def _kill(worker: ForkedWorker) -> None:
    if worker.is_alive():
        worker.kill()
    worker.join(5)
    worker.close()
