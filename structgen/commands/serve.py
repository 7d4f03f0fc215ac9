"""`structgen serve`: the public gRPC server, its engine, and (unless told where one runs)
a supervised grammar_service child on a private Unix socket.

Every flag has a STRUCTGEN_* environment variable (the Helm chart's ConfigMap sets them);
a flag given on the command line wins, then the variable, then the ServeConfig /
EngineConfig default. SIGTERM or SIGINT drains: NOT_SERVING, open streams get
--drain-seconds, then the engine and the grammar child stop.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    flag: str
    env: str          # STRUCTGEN_<env>
    kind: type
    target: str       # "engine" (EngineConfig) or "serve" (ServeConfig)
    field: str
    help: str


def on_off(text: str) -> bool:
    """A boolean flag or variable: true/false, on/off, yes/no, 1/0."""
    lowered = text.strip().lower()
    if lowered in ("true", "on", "yes", "1"):
        return True
    if lowered in ("false", "off", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


OPTIONS = (
    Option("--model", "MODEL", str, "engine", "model", "checkpoint folder, .gguf file, random:<preset>, or a built-in name: default (SmolLM2-135M-Instruct, fetched once) or tiny-random (default: default)"),
    Option("--device", "DEVICE", str, "engine", "device", "torch device: cpu, cuda, cuda:1 (default cpu)"),
    Option("--dtype", "DTYPE", str, "engine", "dtype", "float32, bfloat16, float16 or auto (the checkpoint's)"),
    Option("--max-batch", "MAX_BATCH_SIZE", int, "engine", "max_batch", "most requests decoded together"),
    Option("--max-waiting", "MAX_QUEUE_LENGTH", int, "engine", "max_waiting", "queued requests beyond which Generate is RESOURCE_EXHAUSTED"),
    Option("--num-pages", "NUM_PAGES", int, "engine", "num_pages", "KV-cache pages (default: sized by the engine)"),
    Option("--max-prompt-tokens", "MAX_PROMPT_TOKENS", int, "engine", "max_prompt_tokens", "largest prompt (OUT_OF_RANGE beyond)"),
    Option("--max-new-tokens-limit", "MAX_NEW_TOKENS", int, "engine", "max_new_tokens_limit", "largest max_tokens (OUT_OF_RANGE beyond)"),
    Option("--max-draft-tokens", "MAX_DRAFT_TOKENS", int, "engine", "max_draft_tokens", "most speculative draft tokens per step"),
    Option("--runner", "RUNNER", str, "engine", "runner", "auto (CUDA graphs on a GPU, eager on CPU), cuda_graph, or eager (debugging)"),
    Option("--overlap", "OVERLAP", on_off, "engine", "overlap", "under CUDA graphs, launch decode step N+1 before reading N: true (default) or false (debugging)"),
    Option("--verify-graphs", "VERIFY_GRAPHS", on_off, "engine", "verify_graphs", "under CUDA graphs, run speculative verify steps as graphs too: true (default) or false"),
    Option("--host", "HOST", str, "serve", "host", "address to listen on (default 127.0.0.1; 0.0.0.0 for all)"),
    Option("--port", "PORT", int, "serve", "port", "port to listen on (default 50051; 0 = any free port)"),
    Option("--grammar-address", "GRAMMAR_ADDRESS", str, "serve", "grammar_address", "a running grammar_service, e.g. unix:///run/structgen/grammar.sock (default: spawn one)"),
    Option("--max-message-bytes", "MAX_MESSAGE_BYTES", int, "serve", "max_message_bytes", "largest request message (default 4 MiB)"),
    Option("--max-grammar-bytes", "MAX_GRAMMAR_BYTES", int, "serve", "max_grammar_bytes", "largest constraint text (default 1 MiB)"),
    Option("--default-max-tokens", "DEFAULT_MAX_TOKENS", int, "serve", "default_max_tokens", "max_tokens of requests that leave it 0 (default 256)"),
    Option("--default-temperature", "DEFAULT_TEMPERATURE", float, "serve", "default_temperature", "temperature of requests that leave it unset (default 0 = greedy)"),
    Option("--default-top-p", "DEFAULT_TOP_P", float, "serve", "default_top_p", "top_p of requests that leave it unset (default 1)"),
    Option("--default-top-k", "DEFAULT_TOP_K", int, "serve", "default_top_k", "top_k of requests that leave it unset (default 0 = off)"),
    Option("--num-workers", "NUM_WORKERS", int, "serve", "num_workers", "server threads = most concurrent streams (default 64)"),
    Option("--drain-seconds", "DRAIN_SECONDS", float, "serve", "grace_s", "time open streams get on SIGTERM (default 10)"),
    Option("--health-port", "HEALTH_PORT", int, "serve", "health_port", "extra plaintext port serving only grpc.health.v1 (for probes under TLS/auth)"),
    Option("--metrics-port", "METRICS_PORT", int, "serve", "metrics_port", "Prometheus /metrics port (default off)"),
    Option("--tls-cert", "TLS_CERT", str, "serve", "tls_cert", "PEM certificate: serve the API over TLS"),
    Option("--tls-key", "TLS_KEY", str, "serve", "tls_key", "PEM private key of --tls-cert"),
    Option("--tls-client-ca", "TLS_CLIENT_CA", str, "serve", "tls_client_ca", "PEM CA: require client certificates it signed"),
    Option("--auth-token-file", "AUTH_TOKEN_FILE", str, "serve", "auth_token_file", "require 'authorization: Bearer <token in file>' (health exempt)"),
)

log = logging.getLogger("structgen.serve")
# The engine loop is the serving path's one critical thread, and every streaming RPC has a thread
# of its own: with Python's default 5 ms switch interval, each time the loop gives up the GIL (a
# device sync, a sleep while it waits for masks) it could wait up to 5 ms to get it back.
GIL_SWITCH_INTERVAL_S = 0.0002


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over gRPC", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    from structgen.option_defaults import help_with_default
    for option in OPTIONS:
        parser.add_argument(option.flag, type=option.kind, default=None, dest=option.field,
                            help=f"{help_with_default(option.help, option.target, option.field)} "
                                 f"[$STRUCTGEN_{option.env}]")
    parser.add_argument("--grace-s", type=float, dest="grace_s", help=argparse.SUPPRESS)  # old name
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, ... (default INFO) [$STRUCTGEN_LOG_LEVEL]")
    parser.set_defaults(run=run)


def resolve(args: argparse.Namespace, environ: dict[str, str], target: str) -> dict:
    """Field values for one config: flag, else STRUCTGEN_* variable, else left to the default."""
    values = {}
    for option in OPTIONS:
        if option.target != target:
            continue
        value = getattr(args, option.field)
        if value is None and f"STRUCTGEN_{option.env}" in environ:
            value = option.kind(environ[f"STRUCTGEN_{option.env}"])
        if option.field == "dtype" and value == "auto":
            value = None
        if value is not None:
            values[option.field] = value
    return values


def run(args: argparse.Namespace, _rest) -> int:
    level = (args.log_level or os.environ.get("STRUCTGEN_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from generation_service.config import ServeConfig
    from generation_service.model.config import ModelLoadError
    from structgen import telemetry
    from structgen.serve_preflight import check_before_loading
    try:  # one line, before anything heavy: bad values, a busy port, a missing model, no GPU
        config = ServeConfig(**resolve(args, os.environ, "serve"))
        engine_overrides = resolve(args, os.environ, "engine")
        check_before_loading(config, engine_overrides)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    telemetry.setup("structgen")  # OTEL_* variables; off without an OTLP endpoint
    telemetry.install_log_correlation()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    stop_requested = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop_requested.set())
    try:
        with ServeStack(config, engine_overrides) as stack:
            print(f"structgen serve: listening on {config.host}:{stack.port} "
                  f"(model {stack.model_name}, grammar_service at {stack.grammar_address})", flush=True)
            stop_requested.wait()
            log.info("stopping: draining for up to %.1f s", config.grace_s)
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        telemetry.shutdown()  # flush the last spans (the drained streams')
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


class ServeStack:
    """grammar_service child (optional) -> engine -> gRPC server, torn down in reverse order."""

    def __init__(self, config, engine_overrides: dict):
        self.config = config
        self._engine_overrides = engine_overrides
        self._supervisor = self._engine = self._server = None
        self.grammar_address = config.grammar_address

    def __enter__(self) -> "ServeStack":
        from generation_service.engine.engine import Engine, EngineConfig
        from generation_service.server import start_server
        from grammar_service.client import GrammarControlClient
        from structgen.supervisor import GrammarSupervisor
        try:
            if self.config.spawns_grammar_service:
                self._supervisor = GrammarSupervisor(
                    ("--max-grammar-bytes", str(self.config.max_grammar_bytes)))
                self._supervisor.start()
                self.grammar_address = self._supervisor.address
            self._engine = Engine(EngineConfig(**self._engine_overrides),
                                  GrammarControlClient(self.grammar_address))
            self._engine.start()
            if self._supervisor is not None:
                self._supervisor.set_restart_args(
                    ("--tokenizer-dir", self._engine.tokenizer.path,
                     "--vocab-size", str(self._engine.model_config.vocab_size)))
            self._server = start_server(self._engine, self.config)
            if self.config.metrics_port:
                import prometheus_client
                prometheus_client.start_http_server(self.config.metrics_port, addr=self.config.host)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    def __exit__(self, *exc) -> None:
        # One grace period for the whole drain: the engine gets what the server left over.
        deadline_s = time.monotonic() + self.config.grace_s
        if self._server is not None:
            self._server.stop(self.config.grace_s)
        if self._engine is not None:
            self._engine.stop(max(0.0, deadline_s - time.monotonic()))
        if self._supervisor is not None:
            self._supervisor.stop()
