"""`structgen serve`: the public gRPC server, its engine, and (unless told where one runs)
a supervised grammar_service child on a private Unix socket.

Every flag has a STRUCTGEN_* environment variable (the Helm chart's ConfigMap sets them);
a flag given on the command line wins, then the variable, then the ServeConfig /
EngineConfig default. The flags, variables and chart values all come from one table,
generation_service/settings.py. SIGTERM or SIGINT drains: health answers NOT_SERVING on the
open port while open streams get --drain-seconds, then the server closes and the engine and
the grammar child stop. A signal during start-up stops it between steps and cleans up the
same way.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, TypeVar

from structgen.signals import StopSignals

log = logging.getLogger("structgen.serve")
T = TypeVar("T")
# The engine loop is the serving path's one critical thread, and every streaming RPC has a thread
# of its own: with Python's default 5 ms switch interval, each time the loop gives up the GIL (a
# device sync, a sleep while it waits for masks) it could wait up to 5 ms to get it back.
GIL_SWITCH_INTERVAL_S = 0.0002


def add_parser(subparsers) -> None:
    from generation_service.settings import SERVE_SETTINGS
    parser = subparsers.add_parser("serve", help="serve a model over gRPC", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    SERVE_SETTINGS.add_arguments(parser)
    parser.set_defaults(run=run)


def resolve(args: argparse.Namespace, environ):
    """ProcessConfig, EngineConfig and ServeConfig from flags, STRUCTGEN_* and defaults; raises
    SettingsError. Unknown STRUCTGEN_* variables (a typo, a removed name) become warnings."""
    from generation_service.settings import SERVE_SETTINGS
    from grammar_service.settings import GRAMMAR_SETTINGS
    from structgen.settings import unknown_variables
    resolved = SERVE_SETTINGS.resolve(args, environ)
    from generation_service.config import ServeConfig
    from generation_service.engine.config import EngineConfig
    from structgen.settings import SettingsError
    if resolved[ServeConfig].engine_process is True and resolved[EngineConfig].tensor_parallel > 1:
        raise SettingsError("--engine-process does not go with --tensor-parallel > 1 (rank 0 is the engine)")
    resolved.warnings += [f"{name} is set but no structgen setting reads it"
                          for name in unknown_variables(environ, SERVE_SETTINGS, GRAMMAR_SETTINGS)]
    return resolved


def run(args: argparse.Namespace, _rest) -> int:
    stop = StopSignals()  # NOTE: before anything that must be cleaned up exists
    from generation_service.config import ServeConfig
    from generation_service.engine.config import EngineConfig
    from generation_service.model.config import ModelLoadError
    from generation_service.parallel.plan import TensorParallelError
    from structgen import telemetry
    from structgen.serve_preflight import PreflightError, check_before_loading
    from structgen.settings import ProcessConfig, SettingsError, print_config
    try:
        resolved = resolve(args, os.environ)
        if not args.print_config:  # before anything heavy: a busy port, a missing model, no GPU
            check_before_loading(resolved[ServeConfig], resolved[EngineConfig])
    except (SettingsError, PreflightError) as exc:
        print(f"structgen serve: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print_config(resolved)
        return 0
    logging.basicConfig(level=resolved[ProcessConfig].log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for warning in resolved.warnings:
        log.warning("%s", warning)
    log.info("settings: %s", json.dumps(resolved.as_dict(), sort_keys=True))
    telemetry.setup("structgen")  # OTEL_* variables; off without an OTLP endpoint
    telemetry.install_log_correlation()
    config: ServeConfig = resolved[ServeConfig]
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    stack = ServeStack(config, resolved[EngineConfig], should_stop=lambda: stop.is_set)
    try:
        with stack:
            if stack.http_url:
                print(f"structgen serve: OpenAI-compatible HTTP API on {stack.http_url}", flush=True)
            print(f"structgen serve: listening on {config.host}:{stack.port} "
                  f"(model {stack.model_name}, grammar_service at {stack.grammar_address})", flush=True)
            stop.wait()
            log.info("stopping: draining for up to %.1f s", config.grace_s)
    except StartupCancelled:
        log.info("stopped during start-up")
    except (ModelLoadError, TensorParallelError) as exc:
        print(f"structgen serve: {exc}", file=sys.stderr)
        return 1
    finally:
        telemetry.shutdown()  # flush the last spans (the drained streams')
    if stack.failure is not None:  # a tensor-parallel rank or the engine process died: it stopped the server
        print(f"structgen serve: {stack.failure}", file=sys.stderr, flush=True)
        exit_now(1)
    exit_now(0)


def exit_now(code: int) -> None:
    """Exit without the interpreter's finalization.

    NOTE: call only once everything is released (channel unlinked, child stopped, spans
    flushed). Finalization garbage-collects torch and tokenizer objects for seconds, which
    a drain (SIGTERM -> exit within --drain-seconds) cannot afford."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def uses_engine_process(config, engine_config) -> bool:
    """--engine-process, by default on with a CUDA device and one process: there a small model's
    engine loop is the bound, and sharing the GIL with the gRPC front halved the 1B shape's
    throughput (docs/serving.md, "The engine process")."""
    if config.engine_process is not None:
        return config.engine_process
    return str(engine_config.device).startswith("cuda") and engine_config.tensor_parallel == 1


class StartupCancelled(Exception):
    """A stop signal arrived during start-up; what was started has been stopped."""


class ServeStack:
    """grammar_service child (optional) -> tensor-parallel ranks 1..N-1 (--tensor-parallel N)
    -> engine (rank 0) -> gRPC server (and the HTTP API when --http-port is set), torn down in
    reverse order.

    `should_stop` is polled between start-up steps (and while the grammar child starts): when
    it turns true, the steps done so far are undone and StartupCancelled is raised."""

    def __init__(self, config, engine_config, should_stop: Callable[[], bool] = lambda: False):
        self.config = config
        self._engine_config = engine_config
        self._should_stop = should_stop
        self._supervisor = self._engine = self._server = self._http = self._ranks = None
        self._engine_failure: str | None = None  # --engine-process: why the engine process ended
        self.grammar_address = config.grammar_address

    def _check_stop(self) -> None:
        if self._should_stop():
            raise StartupCancelled("stop signal during start-up")

    def _interruptible(self, step: Callable[[], T]) -> T:
        """step() in a helper thread, or StartupCancelled as soon as a stop arrives; the helper
        is then abandoned (the process exits), so a step here creates nothing outside this
        process: imports and the model, not the step channel."""
        outcome: dict = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["value"] = step()
            except BaseException as error:  # noqa: BLE001 -- re-raised in the caller's thread
                outcome["error"] = error
            finally:
                done.set()

        threading.Thread(target=run, name="serve-start", daemon=True).start()
        while not done.wait(0.05):
            self._check_stop()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _build_engine(self):
        from generation_service.engine.engine import Engine  # torch: seconds
        from grammar_contract.client import GrammarControlClient
        if self._ranks is not None:  # rank 0 joins once every worker has loaded its shard
            self._ranks.join()
        return Engine(self._engine_config, GrammarControlClient(self.grammar_address))

    def _spawn_engine(self):
        """--engine-process: the engine in a child process; its unexpected exit stops this
        process as a stop signal would, and `failure` says so (serve exits nonzero)."""
        from generation_service.engine_process.proxy import RemoteEngine
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        engine = RemoteEngine.spawn(self._engine_config, self.grammar_address, level, GIL_SWITCH_INTERVAL_S,
                                    check_stop=self._check_stop)

        def on_exit(why: str) -> None:
            self._engine_failure = why
            os.kill(os.getpid(), signal.SIGTERM)
        engine.on_exit = on_exit
        return engine

    def _check_ranks(self) -> None:
        """--tensor-parallel N: the supervisor of ranks 1..N-1, once the model divides over them.
        A rank that dies stops this process as a stop signal would (drain, stop), and `failure`
        says which rank (serve exits nonzero)."""
        from generation_service.parallel.launcher import RankSupervisor
        ranks = RankSupervisor(self._engine_config, on_failure=lambda _: os.kill(os.getpid(), signal.SIGTERM))
        ranks.check_model()
        self._ranks = ranks

    @property
    def failure(self) -> str | None:
        return self._ranks.failure if self._ranks is not None else self._engine_failure

    def __enter__(self) -> "ServeStack":
        from structgen.supervisor import GrammarSupervisor
        try:
            self._check_stop()
            if self._engine_config.tensor_parallel > 1:  # the model's shapes, before any child starts
                self._check_ranks()
            if self.config.spawns_grammar_service:  # its imports overlap ours (torch, the model)
                self._supervisor = GrammarSupervisor(
                    ("--max-grammar-bytes", str(self.config.max_grammar_bytes)))
                self._supervisor.spawn()
                self.grammar_address = self._supervisor.address
            if self._ranks is not None:
                self._ranks.spawn()
            if uses_engine_process(self.config, self._engine_config):
                self._engine = self._spawn_engine()
            else:
                self._engine = self._interruptible(self._build_engine)
            from generation_service.server import start_server
            if self._supervisor is not None:
                if self._engine.tokenizer is not None:  # every grammar child has it loaded before it serves
                    self._supervisor.use_tokenizer(self._engine.tokenizer.path, self._engine.model_config.vocab_size)
                self._supervisor.wait_ready(should_stop=self._should_stop)
            self._check_stop()
            self._engine.start()
            self._check_stop()
            self._server = start_server(self._engine, self.config)
            if self.config.http_port:
                from generation_service.openai_http.front import start_http_front
                self._http = start_http_front(self._engine, self.config)
            self._check_stop()
            if self.config.metrics_port:
                import prometheus_client
                prometheus_client.start_http_server(self.config.metrics_port, addr=self.config.host)
            from structgen.heap import freeze_heap
            # the model, tokenizer and imports out of every later full collection
            log.info("heap frozen: %d objects left out of the collector's full passes", freeze_heap())
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def http_url(self) -> str | None:
        return None if self._http is None else self._http.url

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    def __exit__(self, *exc) -> None:
        # One grace period for the whole drain: the engine gets what the server left over.
        deadline_s = time.monotonic() + self.config.grace_s
        if self._http is not None:  # both fronts drain at once
            self._http.begin_stop()
        if self._server is not None:
            self._server.stop(self.config.grace_s)
        if self._http is not None:
            self._http.stop(max(0.0, deadline_s - time.monotonic()))
        if self._engine is not None:
            self._engine.stop(max(0.0, deadline_s - time.monotonic()))
        if self._ranks is not None:  # after the engine: its runner told them to stop
            self._ranks.stop()
        if self._supervisor is not None:
            self._supervisor.stop()
