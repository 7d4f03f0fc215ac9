"""`structgen serve`: the public gRPC server, its engine, and (unless told where one runs)
a supervised grammar_service child on a private Unix socket.

Flags left unset take ServeConfig / EngineConfig defaults (STRUCTGEN_* environment variables
override ServeConfig's). SIGTERM or SIGINT drains: NOT_SERVING, in-flight streams get
--grace-s seconds, then the engine and the grammar child stop.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

# (flag, EngineConfig field, type, help); None defaults mean "EngineConfig's default".
ENGINE_FLAGS = (
    ("--model", "model", str, "built-in model name or checkpoint folder (default: the built-in default model)"),
    ("--device", "device", str, "torch device, e.g. cpu, cuda, cuda:1 (default: cpu)"),
    ("--dtype", "dtype", str, "float32, bfloat16, float16 (default: the checkpoint's)"),
    ("--max-batch", "max_batch", int, "most requests decoded together"),
    ("--max-waiting", "max_waiting", int, "queued requests beyond which Generate is RESOURCE_EXHAUSTED"),
    ("--num-pages", "num_pages", int, "KV-cache pages (default: sized from memory)"),
    ("--page-size", "page_size", int, "tokens per KV-cache page"),
    ("--max-prompt-tokens", "max_prompt_tokens", int, "largest prompt (OUT_OF_RANGE beyond)"),
    ("--max-new-tokens-limit", "max_new_tokens_limit", int, "largest max_tokens (OUT_OF_RANGE beyond)"),
    ("--max-draft-tokens", "max_draft_tokens", int, "most speculative draft tokens per step"),
    ("--grammar-wait-timeout-s", "grammar_wait_timeout_s", float, "seconds before a stuck grammar_service fails constrained requests"),
)
SERVE_FLAGS = (
    ("--host", "host", str, "address to listen on (default 127.0.0.1; 0.0.0.0 for all)"),
    ("--port", "port", int, "port to listen on (default 50051; 0 = any free port)"),
    ("--grammar-address", "grammar_address", str, "a running grammar_service (e.g. unix:///sock/grammar.sock); default: spawn one"),
    ("--max-message-bytes", "max_message_bytes", int, "largest request message (default 4 MiB)"),
    ("--max-grammar-bytes", "max_grammar_bytes", int, "largest constraint text (default 1 MiB)"),
    ("--default-max-tokens", "default_max_tokens", int, "max_tokens of requests that leave it 0 (default 256)"),
    ("--num-workers", "num_workers", int, "server threads = concurrent streams (default 64)"),
    ("--grace-s", "grace_s", float, "drain time on SIGTERM (default 10)"),
)

log = logging.getLogger("structgen.serve")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over gRPC", description=__doc__)
    for flag, _, kind, text in ENGINE_FLAGS + SERVE_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=text)
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(run=run)


def _overrides(args: argparse.Namespace, flags) -> dict:
    return {field: getattr(args, field) for _, field, _, _ in flags if getattr(args, field) is not None}


def run(args: argparse.Namespace, _rest) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from generation_service.config import ServeConfig
    config = ServeConfig.from_env(**_overrides(args, SERVE_FLAGS))
    stop_requested = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop_requested.set())
    with ServeStack(config, _overrides(args, ENGINE_FLAGS)) as stack:
        print(f"structgen serve: listening on {config.host}:{stack.port} "
              f"(model {stack.model_name}, grammar_service at {stack.grammar_address})", flush=True)
        stop_requested.wait()
        log.info("stopping: draining for up to %.1f s", config.grace_s)
    return 0


class ServeStack:
    """grammar_service child (optional) -> engine -> gRPC server, torn down in reverse order."""

    def __init__(self, config, engine_overrides: dict):
        self.config = config
        self._engine_overrides = engine_overrides
        self._supervisor = self._engine = self._server = None

    def __enter__(self) -> "ServeStack":
        from generation_service.engine.engine import Engine, EngineConfig
        from generation_service.server import start_server
        from grammar_service.client import GrammarControlClient
        from structgen.supervisor import GrammarSupervisor
        try:
            self.grammar_address = self.config.grammar_address
            if self.config.spawns_grammar_service:
                self._supervisor = GrammarSupervisor()
                self._supervisor.start()
                self.grammar_address = self._supervisor.address
            self._engine = Engine(EngineConfig(**self._engine_overrides),
                                  GrammarControlClient(self.grammar_address))
            self._engine.start()
            self._server = start_server(self._engine, self.config)
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
        grace_s = self.config.grace_s
        if self._server is not None:
            self._server.stop(grace_s)
        if self._engine is not None:
            self._engine.stop(grace_s)
        if self._supervisor is not None:
            self._supervisor.stop()
