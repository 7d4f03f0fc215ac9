"""Start and stop a real `structgen serve` subprocess (default model, CPU, free port).

The server runs as a subprocess exactly as a user starts it, with a spawned grammar_service
child; tests talk to it over real gRPC (and HTTP: the session server also serves the
OpenAI-compatible API, `LiveServer.http_url`). Small limits make the limit tests cheap:
max_new_tokens_limit 64, max_prompt_tokens 512, max_grammar_bytes 64 KiB, max_message_bytes
256 KiB. Its log goes to <tmp>/serve.log (printed when the server fails to start).
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIMITS = {"max_new_tokens_limit": 64, "max_prompt_tokens": 512, "max_grammar_bytes": 65536,
          "max_message_bytes": 262144, "default_max_tokens": 16}
# The session server's grammar_service gives every mask fill of a grammar containing this text
# SLOW_FILL_MS more (GrammarServiceConfig.slow_fill_ms): a slow grammar on demand (test_api_slow_grammar.py).
SLOW_FILL_MARKER = "structgen-test-slow-fill"
SLOW_FILL_MS = 1000
READY_MARK = "listening on "
HTTP_MARK = "OpenAI-compatible HTTP API on "  # printed before READY_MARK when --http-port is set
STARTUP_TIMEOUT_S = 600  # the first run builds the default model's checkpoint


@dataclass
class LiveServer:
    process: subprocess.Popen
    address: str
    log_path: pathlib.Path
    stdout_lines: list[str] = field(default_factory=list)
    http_url: str = ""  # e.g. http://127.0.0.1:8000, when started with --http-port

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_serve(extra_args: list[str], log_path: pathlib.Path,
                timeout_s: float = STARTUP_TIMEOUT_S, env: dict[str, str] | None = None) -> LiveServer:
    """`structgen serve --port 0 ...` as a subprocess (`env` added to this process's environment);
    returns once it prints its address."""
    argv = [sys.executable, "-m", "structgen.cli", "serve", "--host", "127.0.0.1", "--port", "0",
            *extra_args]
    log_file = open(log_path, "w")
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=log_file, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    server = LiveServer(process, "", log_path)
    ready = threading.Event()

    def pump() -> None:
        for line in process.stdout:
            server.stdout_lines.append(line)
            if HTTP_MARK in line:
                server.http_url = line.split(HTTP_MARK, 1)[1].split()[0]
            if READY_MARK in line and not server.address:
                server.address = line.split(READY_MARK, 1)[1].split()[0]
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.5) and time.monotonic() < deadline:
        pass
    if not server.address:
        process.kill()
        pytest.fail(f"structgen serve did not start (exit {process.poll()}):\n{server.log_text()[-4000:]}")
    return server


def stop_serve(server: LiveServer, timeout_s: float = 60) -> int:
    """SIGTERM (the graceful path a rollout takes) and the exit code."""
    server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        return -9


def wait_idle(client, timeout_s: float = 10.0):
    """The engine's stats once no request holds anything (slots, pages, matchers); fails after
    `timeout_s` with what is still held."""
    deadline = time.monotonic() + timeout_s
    stats = client.engine_stats()
    while not stats.is_idle and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = client.engine_stats()
    assert stats.is_idle, f"engine resources not released: {stats}"
    return stats
