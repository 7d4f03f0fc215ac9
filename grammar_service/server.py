"""The gRPC edge of grammar_service: protos <-> GrammarService calls, health, reflection.

`prepare(config)` is the slow, fork-safe part of start-up (the grammar template does it once for
all the children it forks); `run(config, stop)` runs until SIGTERM/SIGINT; `main(argv)` is the
command line (defaults from GrammarServiceConfig). Errors carrying a `status` (ServiceError, CompileError) become that
gRPC status with their message; anything else is INTERNAL and logged.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from grammar_contract.spec import GrammarSpec, ReasoningSpan
from structgen import telemetry
from structgen.heap import freeze_heap
from structgen.signals import StopSignals
from grammar_service.backends import available_backends, load_backend_class
from grammar_service.compiler import spec_key
from grammar_service.config import GrammarServiceConfig
from grammar_service.forker import WorkerForker
from grammar_service.metrics_endpoint import serve_metrics
from grammar_service.settings import GRAMMAR_SETTINGS
from grammar_service.service import GrammarService, ServiceError
from grammar_service.tokenizer import derive_all, load_tokenizer
from step_channel import Geometry
from structgen.reflection import enable_reflection
from structgen.settings import ProcessConfig, SettingsError, print_config
from structgen.v1 import grammar_pb2, grammar_pb2_grpc

log = logging.getLogger(__name__)
_tracer = telemetry.tracer(__name__)
_FAR_DEADLINE_S = 86400.0
SERVICE_NAME = grammar_pb2.DESCRIPTOR.services_by_name["GrammarService"].full_name


class _StatusInterceptor(grpc.ServerInterceptor):
    """Maps exceptions with a `status` attribute to that status; others to INTERNAL."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        def guarded(request, context):
            try:
                return inner(request, context)
            except Exception as exc:  # noqa: BLE001 -- the edge maps every failure to a status
                status = getattr(exc, "status", None)
                if status is None:
                    log.exception("%s failed", handler_call_details.method)
                    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")
                context.abort(getattr(grpc.StatusCode, status), getattr(exc, "message", str(exc)))

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def preload_backends() -> None:
    """Import every installed backend (xgrammar imports torch: seconds) and the compile workers'
    code before SERVING, so the first OpenChannel waits only for the tokenizer (serve's start-up
    waits on that call) and children forked after this import nothing."""
    importlib.import_module("grammar_service.sandbox_worker")
    for name in available_backends():
        try:
            load_backend_class(name)
        except ValueError:  # not installed here
            pass


def prepare(config: GrammarServiceConfig) -> None:
    """The slow part of start-up, which makes no thread and no gRPC object, so a process may do
    it once and fork servers after it (grammar_service/template.py): the backends imported and
    the preloaded tokenizer loaded with all that is derived from it (done before: at once)."""
    preload_backends()
    if config.tokenizer_dir is not None:
        data, _ = load_tokenizer(config.tokenizer_dir, config.vocab_size)
        derive_all(data)


def spec_from_proto(req: grammar_pb2.CompileRequest) -> GrammarSpec:
    kind = req.WhichOneof("grammar")
    if kind is None:
        raise ServiceError("INVALID_ARGUMENT", "CompileRequest sets no grammar (json_schema, regex, "
                           "lark, structural_tag, json_object or choice)")
    opts = req.options
    try:
        return GrammarSpec(
            kind=kind, text=getattr(req, kind) if kind not in ("json_object", "choice") else "",
            choices=tuple(req.choice.choices) if kind == "choice" else (),
            any_whitespace=opts.any_whitespace,
            max_whitespace=opts.max_whitespace if opts.HasField("max_whitespace") else None,
            single_line=opts.single_line, strict=opts.strict, backend=opts.backend or "auto", reasoning=_reasoning(req),
            max_tokens=req.max_tokens if req.HasField("max_tokens") else None)
    except ValueError as exc:
        raise ServiceError("INVALID_ARGUMENT", str(exc)) from None


def _reasoning(req: grammar_pb2.CompileRequest) -> ReasoningSpan | None:
    if not req.HasField("reasoning"):
        return None
    span = req.reasoning
    return ReasoningSpan(begin=span.begin, end=span.end, separator=span.separator,
                         max_tokens=span.max_tokens if span.HasField("max_tokens") else None,
                         starts_open=span.starts_open)


class GrammarServicer(grammar_pb2_grpc.GrammarServiceServicer):
    def __init__(self, service: GrammarService, max_waiting_compiles: int):
        self.service = service
        # Compile calls blocked on a future hold an rpc thread each; the rest stay free for
        # health, OpenChannel and GetStats, whose delay would read as a stuck service.
        self._compile_calls = threading.BoundedSemaphore(max_waiting_compiles)

    def OpenChannel(self, request, context):
        g = request.geometry
        try:
            geometry = Geometry(max_batch=g.max_batch, max_positions=g.max_positions,
                                vocab_size=g.vocab_size, depth=g.depth)
        except ValueError as exc:
            raise ServiceError("INVALID_ARGUMENT", str(exc)) from None
        num_tokens = self.service.open_channel(
            request.channel_name, geometry, max_slots=request.max_slots, first_step=request.first_step,
            tokenizer_dir=request.tokenizer_dir, tokenizer_fingerprint=request.tokenizer_fingerprint)
        return grammar_pb2.OpenChannelResponse(tokenizer_vocab_size=num_tokens, default_backend="xgrammar")

    def CloseChannel(self, request, context):
        return grammar_pb2.CloseChannelResponse(was_open=self.service.close_channel(request.channel_name))

    def Compile(self, request, context):
        spec = spec_from_proto(request)
        if not self._compile_calls.acquire(blocking=False):
            raise ServiceError("RESOURCE_EXHAUSTED", "grammar_service has too many compile calls waiting; retry later")
        try:
            # The caller's span (propagated in trace_context) is the parent of the compile span.
            with _tracer.start_as_current_span("grammar.compile",
                                               context=telemetry.extract(request.trace_context)) as span:
                span.set_attribute("grammar.kind", spec.kind)
                span.set_attribute("structgen.grammar.hash", spec_key(spec, spec.backend))  # the cache key
                outcome = _wait(self.service.compile(spec), context.time_remaining())
                span.set_attribute("grammar.cache_hit", outcome.cache_hit)
                span.set_attribute("structgen.grammar.backend", outcome.entry.backend)
                span.set_attribute("structgen.grammar.compile_ms", outcome.entry.compile_ms)  # of the first compile
        finally:
            self._compile_calls.release()
        entry = outcome.entry
        return grammar_pb2.CompileResponse(
            grammar_id=entry.grammar_id, backend=entry.backend, cached=outcome.cache_hit,
            compile_ms=0.0 if outcome.cache_hit else entry.compile_ms,
            unenforced=[grammar_pb2.UnenforcedKeyword(keyword=u.keyword, pointer=u.pointer, reason=u.reason)
                        for u in entry.unenforced],
            restricted=[grammar_pb2.UnenforcedKeyword(keyword=u.keyword, pointer=u.pointer, reason=u.reason)
                        for u in entry.restricted], fallback_from=entry.fallback_from)

    def GetStats(self, request, context):
        return grammar_pb2.GetStatsResponse(**self.service.stats())


def _wait(future, time_remaining: float | None):
    """The compile outcome, or DEADLINE_EXCEEDED once the caller's deadline passes (the compile
    itself goes on, bounded by the compile timeout, for later callers of the same grammar)."""
    if time_remaining is not None and time_remaining > _FAR_DEADLINE_S:
        time_remaining = None  # no deadline, as some clients spell it (overflows time_t below)
    try:
        return future.result(timeout=time_remaining)
    except futures.TimeoutError:
        raise ServiceError("DEADLINE_EXCEEDED", "the compile did not finish before the call's deadline") from None


class RunningServer:
    """A started server; `stop()` drains RPCs, closes channels and removes the socket."""

    def __init__(self, config: GrammarServiceConfig, should_stop=lambda: False, forker: WorkerForker | None = None):
        """`should_stop`: polled while the compile workers start, so a stop signal then is not
        held up by them. `forker`: started before this process had threads (`run`); without
        one, the service forks its own here, before this server's gRPC objects exist."""
        self.config = config
        prepare(config)
        self.service = GrammarService(config, forker=forker, after_tokenizer_load=freeze_heap)
        self.health = health.HealthServicer()
        for name in ("", SERVICE_NAME):  # grpc's servicer starts at SERVING for "": not before we are
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server = grpc.server(futures.ThreadPoolExecutor(config.num_rpc_threads),
                                  interceptors=[_StatusInterceptor()])
        grammar_pb2_grpc.add_GrammarServiceServicer_to_server(
            GrammarServicer(self.service, max_waiting_compiles=config.num_rpc_threads - 3), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection((SERVICE_NAME, health.SERVICE_NAME), self.server)
        path = config.socket_path
        if path and os.path.exists(path):
            os.unlink(path)  # a stale socket of a previous run
        old_umask = os.umask(0o177)  # the socket file is created 0600
        try:
            if self.server.add_insecure_port(config.listen) == 0 and not path:
                raise OSError(f"cannot listen on {config.listen}")
            self.server.start()
        finally:
            os.umask(old_umask)
        self._socket_inode = None
        if path:
            os.chmod(path, 0o600)
            # a supervisor may rename this socket (standby takeover) and put another at `path`
            self._socket_inode = os.stat(path).st_ino
        self.health_server = None
        if config.health_port:  # kubelet grpc probes cannot reach a Unix socket
            self.health_server = grpc.server(futures.ThreadPoolExecutor(2))
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_server.add_insecure_port(f"0.0.0.0:{config.health_port}")
            self.health_server.start()
        if config.metrics_port:
            serve_metrics(config.metrics_port, path, self._socket_inode)
        freeze_heap()
        # SERVING means a compile can start at once: a preloaded tokenizer's workers are up
        deadline = time.monotonic() + 120.0
        while not self.service.wait_compile_ready(0.1) and not should_stop():
            if time.monotonic() > deadline:
                log.warning("compile workers did not start within 120 s; compiles wait for them")
                break
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("grammar_service listening on %s", config.listen)

    def stop(self) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(self.config.shutdown_grace_s).wait()
        if self.health_server is not None:
            self.health_server.stop(0)
        self.service.close()
        path = self.config.socket_path
        try:
            if path and os.stat(path).st_ino == self._socket_inode:
                os.unlink(path)
        except FileNotFoundError:
            pass


def run(config: GrammarServiceConfig, stop: StopSignals, lifeline_fd: int | None = None) -> None:
    """Serve until SIGTERM or SIGINT (or the end of `lifeline_fd`, a pipe whose writer is the
    process this one serves), then drain and shut down cleanly. A signal that arrives while the
    server starts stops it as soon as it is up."""
    if not stop.is_set:
        prepare(config)  # the slow steps first (imports: seconds), skipped once a stop arrived
    if stop.is_set:
        log.info("grammar_service stopped during start-up")
        return
    # NOTE: before any thread (span export, lifeline, gRPC): the forker is a copy of this process
    forker = WorkerForker.start() if config.isolate_compiles else None
    if lifeline_fd is not None:
        threading.Thread(target=_stop_at_end, args=(lifeline_fd,), name="lifeline", daemon=True).start()
    telemetry.setup("structgen-grammar")
    telemetry.install_log_correlation()
    try:
        running = RunningServer(config, should_stop=lambda: stop.is_set, forker=forker)
        stop.wait()
        log.info("grammar_service shutting down")
        running.stop()
    finally:
        if forker is not None:
            forker.close()
        telemetry.shutdown()


def _stop_at_end(fd: int) -> None:
    while os.read(fd, 1):  # nobody writes: this returns at the end, when the writer is gone
        pass
    log.warning("the process grammar_service serves is gone; stopping")
    os.kill(os.getpid(), signal.SIGTERM)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="structgen grammar", description="Run grammar_service.")
    GRAMMAR_SETTINGS.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None, environ=None) -> int:
    stop = StopSignals()  # NOTE: before the socket, the workers or any other resource exists
    args = build_parser().parse_args(argv)
    try:
        resolved = GRAMMAR_SETTINGS.resolve(args, os.environ if environ is None else environ)
    except SettingsError as exc:
        print(f"structgen grammar: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print_config(resolved)
        return 0
    logging.basicConfig(level=resolved[ProcessConfig].log_level.upper(),
                        format="%(asctime)s %(levelname)s grammar_service %(name)s: %(message)s")
    for warning in resolved.warnings:
        log.warning("%s", warning)
    log.info("settings: %s", json.dumps(resolved.as_dict(), sort_keys=True))
    run(resolved[GrammarServiceConfig], stop)
    exit_now()


def exit_now() -> None:
    """Exit without the interpreter's finalization: collecting xgrammar/tokenizer objects takes
    seconds, and serve's drain budget waits for this exit. NOTE: only once all is released
    (socket unlinked, channels closed, spans flushed)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
