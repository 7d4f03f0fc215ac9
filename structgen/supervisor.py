"""Runs grammar_service as a child process of `structgen serve` and keeps it alive.

The child listens on a Unix socket in a private temporary folder (mode 0700). When it exits
unexpectedly it is restarted on the same socket after a backoff (doubling from
`min_backoff_s` to `max_backoff_s`, reset once a child has lived `stable_after_s`); the
engine's control client reconnects to the same address. `stop()` terminates it and removes
the folder. On Linux the child also gets SIGTERM if this process dies (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("structgen.supervisor")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def wait_healthy(address: str, timeout_s: float, process: subprocess.Popen | None = None) -> bool:
    """True once a grpc.health.v1 Check on `address` answers SERVING; False after timeout_s,
    or as soon as `process` (the server, when the caller started it) has exited."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and (process is None or process.poll() is None):
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False


class GrammarSupervisor:
    def __init__(self, extra_args: tuple[str, ...] = (), *, min_backoff_s: float = 0.5,
                 max_backoff_s: float = 10.0, stable_after_s: float = 30.0):
        self._extra_args = extra_args
        self._min_backoff_s, self._max_backoff_s = min_backoff_s, max_backoff_s
        self._stable_after_s = stable_after_s
        self._folder = tempfile.mkdtemp(prefix="structgen-grammar-")  # 0700
        self.socket_path = os.path.join(self._folder, "grammar.sock")
        self._process: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.num_restarts = 0
        self._restart_args: tuple[str, ...] = ()

    def set_restart_args(self, args: tuple[str, ...]) -> None:
        """Extra flags for restarted children only, e.g. the tokenizer to preload: a restarted
        grammar_service must compile before the engine has re-opened its channel."""
        self._restart_args = tuple(args)

    @property
    def address(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def _spawn(self, extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # a crashed child leaves its socket behind
        argv = [sys.executable, "-m", "structgen.cli", "grammar", "--listen", self.address,
                *self._extra_args, *extra_args]
        env = dict(os.environ)
        if env.get("OTEL_SERVICE_NAME"):  # its spans show as a second service, as in the chart
            env["OTEL_SERVICE_NAME"] += "-grammar"
        # NOTE: a session of its own: Ctrl-C in a terminal (SIGINT to the foreground group)
        # must not stop the child while serve still drains constrained streams through it.
        return subprocess.Popen(argv, preexec_fn=_die_with_parent, env=env, start_new_session=True)

    def start(self, ready_timeout_s: float = 120.0) -> None:
        """Spawn the child and wait until it reports SERVING."""
        self._process = self._spawn()
        if not wait_healthy(self.address, ready_timeout_s, self._process):
            code = self._process.poll()
            self.stop()
            raise RuntimeError(f"grammar_service exited with {code} before it was healthy" if code is not None
                               else f"grammar_service did not become healthy within {ready_timeout_s} s")
        self._watcher = threading.Thread(target=self._watch, name="grammar-supervisor", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        backoff_s = self._min_backoff_s
        while not self._stopping.is_set():
            started = time.monotonic()
            code = self._process.wait()
            if self._stopping.is_set():
                return
            if time.monotonic() - started >= self._stable_after_s:
                backoff_s = self._min_backoff_s
            log.warning("grammar_service exited with %s; restarting in %.1f s", code, backoff_s)
            if self._stopping.wait(backoff_s):
                return
            self._process = self._spawn(self._restart_args)
            self.num_restarts += 1
            backoff_s = min(backoff_s * 2, self._max_backoff_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the child (SIGTERM, then SIGKILL after timeout_s) and remove the folder."""
        self._stopping.set()
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._watcher is not None:
            self._watcher.join(timeout_s)
        shutil.rmtree(self._folder, ignore_errors=True)
