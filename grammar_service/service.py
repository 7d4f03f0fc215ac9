"""grammar_service as a domain object: tokenizer, backends, compiler and open channels.

No grpc here: server.py converts protos to these calls and `ServiceError.status` to gRPC
status codes. Tests and benchmarks drive the same object in-process.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from grammar_contract.spec import GrammarSpec
from grammar_service.backends import DEFAULT_BACKEND, load_backend_class, resolve_backend_name
from grammar_service.backends.base import GrammarBackend, TokenizerData
from grammar_service.budget.bindings import Binding, BudgetBindings, BudgetTooSmall
from grammar_service.budget.openers import opening_characters
from grammar_service.budget.rows import RowBudget
from grammar_service.compiler import CompileError, CompileOutcome, GrammarCompiler
from grammar_service.config import GrammarServiceConfig
from grammar_service.forker import WorkerForker
from grammar_service.loop import StepLoop
from grammar_service.sandbox import CompileSandbox
from grammar_service.shared_grammars import SharedGrammars
from grammar_service.tokenizer import load_tokenizer
from step_channel import ChannelError, Geometry, StepChannel

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """A refused control call; `status` is a grpc.StatusCode name."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class _Tokenizer:
    path: str
    vocab_size: int
    data: TokenizerData
    fingerprint: str


class GrammarService:
    def __init__(self, config: GrammarServiceConfig, *, forker: WorkerForker | None = None,
                 after_tokenizer_load: Callable[[], None] = lambda: None):
        """`forker`: where compile workers come from (config.isolate_compiles); without one, one is
        forked here, so make the service before this process has threads that matter (the server
        starts its forker before anything else). `after_tokenizer_load` runs after each tokenizer
        load, with no channel open (the server freezes the heap there: structgen.heap.freeze_heap)."""
        self.config = config
        self._owns_forker = forker is None and config.isolate_compiles
        self._forker = WorkerForker.start() if self._owns_forker else forker
        self._after_tokenizer_load = after_tokenizer_load
        self._lock = threading.Lock()
        self._tokenizer: _Tokenizer | None = None
        self._backends: dict[str, GrammarBackend] = {}
        self._compiler: GrammarCompiler | None = None
        self._shared: SharedGrammars | None = None  # config.shared_grammars_dir, for this tokenizer
        self._bindings = BudgetBindings(4 * config.max_cached_grammars)  # (grammar, max_tokens) -> id
        self._loops: dict[str, StepLoop] = {}
        self._slow_grammar_ids: set[int] = set()  # GrammarServiceConfig.slow_fill_marker
        self._closed_steps = 0      # steps of channels already closed (stats are cumulative)
        self._closed_step_us = 0.0
        if config.tokenizer_dir is not None:
            self._use_tokenizer(config.tokenizer_dir, config.vocab_size)

    # ---- tokenizer and backends ----------------------------------------------------------
    def _use_tokenizer(self, tokenizer_dir: str, vocab_size: int) -> _Tokenizer:
        current = self._tokenizer
        if current is not None and (current.path, current.vocab_size) == (tokenizer_dir, vocab_size):
            return current
        try:
            data, fingerprint = load_tokenizer(tokenizer_dir, vocab_size)
        except Exception as exc:  # OSError, ValueError, or the tokenizers library's own errors
            raise ServiceError("FAILED_PRECONDITION", f"cannot load tokenizer from {tokenizer_dir}: {exc}") from None
        if current is not None and current.fingerprint == fingerprint:
            return current
        if self._loops:
            raise ServiceError("FAILED_PRECONDITION", "a channel with another tokenizer "
                               f"({current.path}) is open; close it before switching tokenizers")
        self._close_compiler()
        self._tokenizer = _Tokenizer(tokenizer_dir, vocab_size, data, fingerprint)
        self._backends = {}
        shared = self._shared_grammars(fingerprint)
        self._compiler = GrammarCompiler(self._backend, self.config, sandbox=self._sandbox(tokenizer_dir, vocab_size),
                                         on_reuse=shared.record if shared else lambda key, spec: None)
        self._backend(DEFAULT_BACKEND)  # build it now, not on the first compile
        if shared is not None:
            threading.Thread(target=shared.mirror, args=(self._compiler.is_cached, self._compiler.compile,
                                                         lambda: bool(self._loops)),
                             name="shared-grammars", daemon=True).start()
        log.info("tokenizer %s loaded (vocab_size %d, fingerprint %s)", tokenizer_dir, vocab_size, fingerprint[:16])
        self._after_tokenizer_load()
        return self._tokenizer

    def _backend_kwargs(self) -> dict:
        return dict(num_compile_threads=self.config.num_compile_threads, num_fill_threads=self.config.num_fill_threads,
                    min_parallel_advance_rows=self.config.min_parallel_advance_rows,
                    num_llguidance_lanes=self.config.num_llguidance_lanes)

    def _shared_grammars(self, fingerprint: str) -> SharedGrammars | None:
        if self.config.shared_grammars_dir is None:
            return None
        self._shared = SharedGrammars(self.config.shared_grammars_dir, fingerprint)
        return self._shared

    def _close_compiler(self) -> None:
        if self._shared is not None:
            self._shared.stop()
            self._shared = None
        if self._compiler is not None:
            self._compiler.close()

    def _sandbox(self, tokenizer_dir: str, vocab_size: int) -> CompileSandbox | None:
        if self._forker is None:
            return None
        return CompileSandbox(self._forker, tokenizer_dir, vocab_size, num_workers=self.config.num_compile_threads,
                              backend_kwargs=self._backend_kwargs(),
                              max_compile_memory_mb=self.config.max_compile_memory_mb,
                              auto_time_box_s=self.config.auto_time_box_s)

    def _backend(self, name: str) -> GrammarBackend:
        name = resolve_backend_name(name)
        if name not in self._backends:
            cls = load_backend_class(name)
            self._backends[name] = cls(self._tokenizer.data, **self._backend_kwargs())
        return self._backends[name]

    def _lookup_grammar(self, grammar_id: int) -> tuple[GrammarBackend, object] | None:
        """(backend, compiled grammar) of a grammar id or a budget binding id."""
        binding = self._binding(grammar_id)
        entry = self._compiler.get(binding.grammar_id if binding else grammar_id) if self._compiler else None
        return None if entry is None else (self._backend(entry.backend), entry.compiled)

    def _binding(self, grammar_id: int) -> Binding | None:
        return self._bindings.get(grammar_id) if BudgetBindings.is_binding_id(grammar_id) else None

    def _row_budget(self, grammar_id: int) -> RowBudget | None:
        """A new row's budget: that of its binding id, None for a bare grammar id."""
        binding = self._binding(grammar_id)
        return binding.row_budget() if binding is not None else None

    # ---- control calls -------------------------------------------------------------------
    def open_channel(self, name: str, geometry: Geometry, *, max_slots: int, first_step: int,
                     tokenizer_dir: str, tokenizer_fingerprint: str) -> int:
        """Attach the region, check the tokenizer identity, start the loop; returns its vocab length."""
        if max_slots < 1:
            raise ServiceError("INVALID_ARGUMENT", f"max_slots must be >= 1, got {max_slots}")
        with self._lock:
            if name in self._loops:
                raise ServiceError("ALREADY_EXISTS", f"channel {name} is already open")
            tok = self._use_tokenizer(tokenizer_dir, geometry.vocab_size)
            if tok.fingerprint != tokenizer_fingerprint:
                raise ServiceError("FAILED_PRECONDITION", self._mismatch_message(tok, tokenizer_fingerprint))
            try:
                channel = StepChannel.attach(name, geometry)
            except ChannelError as exc:
                raise ServiceError("FAILED_PRECONDITION", str(exc)) from None
            loop = StepLoop(channel, max_slots, first_step, self._lookup_grammar,
                            wait_spin_s=self.config.step_wait_spin_us / 1e6,
                            isolate_slow_rows=self.config.isolate_slow_rows, fill_delay_of=self._fill_delay_s,
                            budget_of=self._row_budget)
            self._loops[name] = loop
            loop.start()
        log.info("channel %s open: %s, %d slots, first step %d", name, geometry, max_slots, first_step)
        return sum(1 for t in tok.data.encoded_vocab if t)

    @staticmethod
    def _mismatch_message(tok: _Tokenizer, theirs: str) -> str:
        num_ids = sum(1 for t in tok.data.encoded_vocab if t)
        return (f"tokenizer mismatch: the caller's fingerprint {theirs[:16] or '(empty)'}... differs from "
                f"{tok.fingerprint[:16]}... that grammar_service computed from {tok.path} at vocab_size "
                f"{tok.vocab_size} ({num_ids} token ids below it); check that both processes use the "
                "same tokenizer.json and the same vocab_size (the model's logits width)")

    def close_channel(self, name: str) -> bool:
        with self._lock:
            loop = self._loops.pop(name, None)
        if loop is None:
            return False
        loop.stop()
        loop.channel.close()
        self._closed_steps += loop.num_steps
        self._closed_step_us += loop.total_step_ns / 1e3
        log.info("channel %s closed after %d steps", name, loop.num_steps)
        return True

    def compile(self, spec: GrammarSpec) -> Future:
        """Future[CompileOutcome]; CompileError / ServiceError through the future."""
        with self._lock:
            compiler = self._compiler
        if compiler is None:
            f: Future = Future()
            f.set_exception(ServiceError("FAILED_PRECONDITION", "no tokenizer loaded yet: open a "
                                         "channel first or start grammar_service with --tokenizer-dir"))
            return f
        future = compiler.compile(spec)
        if spec.max_tokens is not None:
            future = self._bound(future, spec)
        marker = self.config.slow_fill_marker
        if self.config.slow_fill_ms and marker and marker in spec.text + "".join(spec.choices):
            future.add_done_callback(self._mark_slow)
        return future

    def _bound(self, compiled: Future, spec: GrammarSpec) -> Future:
        """The outcome of `compiled` with a binding id of the grammar and spec.max_tokens (the
        shortest document is found in the thread that completes the compile)."""
        result: Future = Future()

        def bind(done: Future) -> None:
            if (exc := done.exception()) is not None:
                result.set_exception(exc)
                return
            outcome: CompileOutcome = done.result()
            entry = outcome.entry
            is_json = spec.kind in ("json_schema", "json_object") and spec.reasoning is None
            try:
                binding_id = self._bindings.bind(entry.grammar_id, self._backend(entry.backend), entry.compiled,
                                                 spec.max_tokens, is_json, opening_characters(spec))
            except BudgetTooSmall as exc:
                result.set_exception(CompileError("INVALID_ARGUMENT", str(exc)))
                return
            except Exception as exc:  # noqa: BLE001 (a bug in the walk must not lose the answer)
                log.exception("closing walk of grammar %d failed", entry.grammar_id)
                result.set_exception(CompileError("INTERNAL", f"budget binding failed: {exc!r}"))
                return
            result.set_result(dataclasses.replace(outcome, entry=dataclasses.replace(entry, grammar_id=binding_id)))

        compiled.add_done_callback(bind)
        return result

    def _mark_slow(self, future: Future) -> None:
        if future.exception() is None:
            self._slow_grammar_ids.add(future.result().entry.grammar_id)

    def _fill_delay_s(self, grammar_id: int) -> float:
        """GrammarServiceConfig.slow_fill_ms for grammars marked by slow_fill_marker, else 0."""
        return self.config.slow_fill_ms / 1e3 if grammar_id in self._slow_grammar_ids else 0.0

    def stats(self) -> dict:
        loops = list(self._loops.values())
        compiler = self._compiler
        steps = self._closed_steps + sum(loop.num_steps for loop in loops)
        return {
            "num_channels": len(loops),
            "num_bound_matchers": sum(loop.slots.num_bound for loop in loops),
            "num_cached_grammars": compiler.num_cached if compiler else 0,
            "num_cached_errors": compiler.num_negative if compiler else 0,
            "num_cache_hits": compiler.stats.num_cache_hits if compiler else 0,
            "num_compiles": compiler.stats.num_compiles if compiler else 0,
            "num_steps": steps,
            "mean_step_us": (sum(loop.mean_step_us for loop in loops) / len(loops)) if loops else 0.0,
            "total_step_us": self._closed_step_us + sum(loop.total_step_ns for loop in loops) / 1e3,
        }

    def recent_step_us(self) -> dict[str, dict[str, float]]:
        """Per open channel: percentiles of its last 1024 step times (`StepLoop.recent_step_us`)."""
        return {name: loop.recent_step_us() for name, loop in list(self._loops.items())}

    def wait_compile_ready(self, timeout_s: float) -> bool:
        """True once the compile workers of the loaded tokenizer have started (or compiles are
        not isolated, or no tokenizer is loaded yet)."""
        compiler = self._compiler
        return compiler is None or compiler.wait_ready(timeout_s)

    def close(self) -> None:
        for name in list(self._loops):
            self.close_channel(name)
        self._close_compiler()
        if self._owns_forker:
            self._forker.close()
