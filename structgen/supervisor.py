"""Runs grammar_service as a child process of `structgen serve` and keeps it alive.

The child listens on a Unix socket in a private temporary folder (mode 0700). Once the
tokenizer is known (`set_restart_args`), a warm standby child starts beside it on a socket
of its own with the tokenizer preloaded and its compile workers up. When the serving child
exits unexpectedly, the standby's socket is renamed onto the serving path (the listening
socket follows its file), so the engine's control client reconnects to a process that can
compile at once, and a new standby starts after a backoff (doubling from `min_backoff_s` to
`max_backoff_s`, reset once a child has lived `stable_after_s`). Without a ready standby the
child is restarted on the same socket after that backoff. `stop()` terminates both and
removes the folder. On Linux the children also get SIGTERM if this process dies
(PR_SET_PDEATHSIG); every child is spawned from a thread that lives as long as the
supervisor, since the signal follows the spawning thread.
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
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("structgen.supervisor")
# short reconnect backoff: a standby's socket appears only once it listens
_FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]
# Until the standby serves, its health is asked this often: each check is an rpc in the serving
# process, whose GIL the engine loop needs.
STANDBY_CHECK_S = 0.25


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:  # runs in the child between fork and exec
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    return preexec


def wait_healthy(address: str, timeout_s: float, process: subprocess.Popen | None = None,
                 should_stop: Callable[[], bool] = lambda: False) -> bool:
    """True once a grpc.health.v1 Check on `address` answers SERVING; False after timeout_s,
    as soon as `process` (the server, when the caller started it) has exited, or once
    `should_stop()` is true."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and (process is None or process.poll() is None) and not should_stop():
            if _is_serving(stub, 1.0):
                return True
            time.sleep(0.1)
    return False


def _is_serving(stub, timeout_s: float) -> bool:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status == \
            health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class GrammarSupervisor:
    def __init__(self, extra_args: tuple[str, ...] = (), *, min_backoff_s: float = 0.5,
                 max_backoff_s: float = 10.0, stable_after_s: float = 30.0, standby: bool = True):
        self._extra_args = extra_args
        self._min_backoff_s, self._max_backoff_s = min_backoff_s, max_backoff_s
        self._stable_after_s = stable_after_s
        self._folder = tempfile.mkdtemp(prefix="structgen-grammar-")  # 0700
        self.socket_path = os.path.join(self._folder, "grammar.sock")
        self._standby_path = os.path.join(self._folder, "standby.sock")
        self._use_standby = standby
        self._process: subprocess.Popen | None = None
        self._standby: subprocess.Popen | None = None
        self._is_standby_ready = False
        self._standby_channel: grpc.Channel | None = None  # health checks of the standby
        self._next_standby_check_s = 0.0  # a check is an rpc: every STANDBY_CHECK_S, not every poll
        self._is_ready = False  # the first child reported SERVING
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.num_restarts = 0
        self.num_takeovers = 0  # restarts served by the warm standby
        self._restart_args: tuple[str, ...] = ()

    def set_restart_args(self, args: tuple[str, ...]) -> None:
        """Extra flags for restarted and standby children only, e.g. the tokenizer to preload: a
        restarted grammar_service must compile before the engine has re-opened its channel."""
        self._restart_args = tuple(args)

    @property
    def address(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def standby_pid(self) -> int | None:
        """The warm standby's pid once it reports SERVING, else None."""
        standby = self._standby
        return standby.pid if standby is not None and self._is_standby_ready else None

    def _spawn(self, path: str, extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
        if os.path.exists(path):
            os.unlink(path)  # a crashed child leaves its socket behind
        argv = [sys.executable, "-m", "structgen.cli", "grammar", "--listen", f"unix://{path}",
                *self._extra_args, *extra_args]
        env = dict(os.environ)
        if env.get("OTEL_SERVICE_NAME"):  # its spans show as a second service, as in the chart
            env["OTEL_SERVICE_NAME"] += "-grammar"
        # its temporary files (multiprocessing's forkserver folder) go where stop() cleans up:
        # grammar_service leaves without the interpreter's finalization, which would remove them
        env["TMPDIR"] = self._folder
        # NOTE: a session of its own: Ctrl-C in a terminal (SIGINT to the foreground group)
        # must not stop the child while serve still drains constrained streams through it.
        return subprocess.Popen(argv, preexec_fn=_die_with_parent(os.getpid()), env=env, start_new_session=True)

    def start(self, ready_timeout_s: float = 120.0, should_stop: Callable[[], bool] = lambda: False) -> None:
        """`spawn()` then `wait_ready()`."""
        self.spawn()
        self.wait_ready(ready_timeout_s, should_stop)

    def spawn(self) -> None:
        """Start the child without waiting for it (its start-up overlaps the caller's)."""
        self._process = self._spawn(self.socket_path)

    def wait_ready(self, ready_timeout_s: float = 120.0, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Wait until the spawned child reports SERVING (or `should_stop()`: then the child is
        stopped again and this returns; the caller checks its own stop condition)."""
        self._is_ready = wait_healthy(self.address, ready_timeout_s, self._process, should_stop)
        if not self._is_ready:
            code = self._process.poll()
            self.stop()
            if should_stop():
                return
            raise RuntimeError(f"grammar_service exited with {code} before it was healthy" if code is not None
                               else f"grammar_service did not become healthy within {ready_timeout_s} s")
        self._watcher = threading.Thread(target=self._watch, name="grammar-supervisor", daemon=True)
        self._watcher.start()

    # ---- the watcher thread: every spawn after the first happens here --------------------
    def _watch(self) -> None:
        backoff_s = self._min_backoff_s
        started = time.monotonic()
        standby_after = 0.0  # monotonic time before which no standby is spawned
        try:
            while not self._stopping.wait(0.02):  # a poll() is one waitpid: the takeover waits on it
                if self._use_standby and self._restart_args:
                    standby_after = self._tend_standby(standby_after, backoff_s)
                code = self._process.poll()
                if code is None:
                    continue
                if time.monotonic() - started >= self._stable_after_s:
                    backoff_s = self._min_backoff_s
                if self._take_over():
                    log.warning("grammar_service exited with %s; its warm standby (pid %d) took over",
                                code, self._process.pid)
                    standby_after = time.monotonic() + backoff_s
                else:
                    log.warning("grammar_service exited with %s; restarting in %.1f s (no standby was ready)",
                                code, backoff_s)
                    if self._stopping.wait(backoff_s):
                        return
                    self._process = self._spawn(self.socket_path, self._restart_args)
                self.num_restarts += 1
                started = time.monotonic()
                backoff_s = min(backoff_s * 2, self._max_backoff_s)
        finally:
            self._close_standby_channel()

    def _tend_standby(self, standby_after: float, backoff_s: float) -> float:
        """Spawn a standby when there is none, and mark it ready once it serves."""
        standby = self._standby
        if standby is None:
            if time.monotonic() >= standby_after:
                # no metrics port: the serving child holds it (the standby would fail to bind and exit)
                self._standby = self._spawn(self._standby_path, (*self._restart_args, "--metrics-port", "0"))
                self._is_standby_ready = False
                # NOTE: a channel of its own: one opened before a takeover stays connected to the
                # process that moved to the serving path, and would call that one ready
                self._standby_channel = grpc.insecure_channel(f"unix://{self._standby_path}", options=_FAST_RECONNECT)
            return standby_after
        if standby.poll() is not None:
            log.warning("grammar_service standby exited with %s; another starts in %.1f s",
                        standby.returncode, backoff_s)
            self._standby, self._is_standby_ready = None, False
            self._close_standby_channel()
            return time.monotonic() + backoff_s
        if self._is_standby_ready or time.monotonic() < self._next_standby_check_s:
            return standby_after
        self._next_standby_check_s = time.monotonic() + STANDBY_CHECK_S
        if _is_serving(health_pb2_grpc.HealthStub(self._standby_channel), 0.2):
            self._is_standby_ready = True
            log.info("grammar_service standby (pid %d) is ready to take over", standby.pid)
        return standby_after

    def _close_standby_channel(self) -> None:
        if self._standby_channel is not None:
            self._standby_channel.close()
            self._standby_channel = None

    def _take_over(self) -> bool:
        """Move a ready standby onto the serving socket; False when there is none."""
        standby = self._standby
        if standby is None or not self._is_standby_ready or standby.poll() is not None:
            return False
        os.replace(self._standby_path, self.socket_path)  # the listening socket follows its file
        self._process, self._standby, self._is_standby_ready = standby, None, False
        self._close_standby_channel()
        self.num_takeovers += 1
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the children (SIGTERM, then SIGKILL after timeout_s) and remove the folder."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(timeout_s)  # no spawn races the terminations below
        for process in (self._process, self._standby):
            if process is not None and process.poll() is None:
                process.terminate()
        for process, has_served in ((self._process, self._is_ready), (self._standby, self._is_standby_ready)):
            if process is None:
                continue
            try:  # a child that never served has nothing to drain: a second to exit, then SIGKILL
                process.wait(timeout_s if has_served else min(timeout_s, 1.0))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            try:  # its session's stragglers (a forkserver still importing, compile workers)
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        shutil.rmtree(self._folder, ignore_errors=True)
