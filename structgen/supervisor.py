"""Runs grammar_service children for `structgen serve` and keeps one serving at all times.

`spawn()` starts the grammar template (grammar_service/template.py), which imports while serve
loads its model; `use_tokenizer()` names the tokenizer every child preloads; `wait_ready()`
has the template fork the serving child and waits for its health. Children are forked from the
template's initialised state, so one is ready in well under a second (docs/grammar_service.md,
"Start-up").

The serving child listens on a Unix socket in a private temporary folder (mode 0700). A warm
standby child listens on a socket of its own from the moment the serving child is ready, and
again as soon as it has taken over: when the serving child exits, the standby's socket is
renamed onto the serving path (the listening socket follows its file), so the engine's control
client reconnects to a process that can compile at once. A standby still starting then takes
over as soon as it is ready; with none, a new child is forked onto the serving path. Only
children that end before they are ready (a start-up that fails) delay the next by a backoff
(doubling from `min_backoff_s` to `max_backoff_s`, reset by the next child that gets ready).

Every child records the grammars it compiled in a folder shared with the others
(`--shared-grammars-dir`), and compiles those the others recorded, so the standby that takes
over already holds the compiled grammars of the one it replaces.

`stop()` terminates the children and the template and removes the folder. The template gets
SIGTERM if this process dies (PR_SET_PDEATHSIG; every process is started from a thread that
lives as long as the supervisor, since the signal follows the starting thread), and the
children stop at the end of a lifeline pipe only this process writes to.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from structgen.grammar_template import GrammarTemplate, TemplateError
from structgen.process_handle import ProcessHandle

log = logging.getLogger("structgen.supervisor")
# short reconnect backoff: a standby's socket appears only once it listens
_FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]
# Until the standby serves, its health is asked this often: each check is an rpc in the serving
# process, whose GIL the engine loop needs.
STANDBY_CHECK_S = 0.05
FORK_TIMEOUT_S = 120.0  # a fork waits for the template's imports and tokenizer (once)


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:  # runs in the child between fork and exec
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    return preexec


def wait_healthy(address: str, timeout_s: float, process: ProcessHandle | subprocess.Popen | None = None,
                 should_stop: Callable[[], bool] = lambda: False) -> bool:
    """True once a grpc.health.v1 Check on `address` answers SERVING; False after timeout_s,
    as soon as `process` (the server, when the caller started it) has exited, or once
    `should_stop()` is true."""
    deadline = time.monotonic() + timeout_s

    def is_running() -> bool:
        if process is None:
            return True
        return process.poll() is None if isinstance(process, subprocess.Popen) else not process.has_exited()

    with grpc.insecure_channel(address, options=_FAST_RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and is_running() and not should_stop():
            if _is_serving(stub, 1.0):
                return True
            time.sleep(0.02)
    return False


def _is_serving(stub, timeout_s: float) -> bool:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status == \
            health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class _Child:
    """A forked child, and the channel its health is asked on until it is ready.

    NOTE: a channel of its own, to the path the child was forked onto: one opened before a
    takeover stays connected to the process that moved to the serving path."""

    def __init__(self, process: ProcessHandle, path: str):
        self.process = process
        self.is_ready = False
        self._channel: grpc.Channel | None = grpc.insecure_channel(f"unix://{path}", options=_FAST_RECONNECT)
        self._next_check_s = 0.0  # a check is an rpc: every STANDBY_CHECK_S, not every poll

    @property
    def pid(self) -> int:
        return self.process.pid

    def became_ready(self) -> bool:
        """True once, when a health check first finds it SERVING."""
        if self.is_ready or self._channel is None or time.monotonic() < self._next_check_s:
            return False
        self._next_check_s = time.monotonic() + STANDBY_CHECK_S
        self.is_ready = _is_serving(health_pb2_grpc.HealthStub(self._channel), 0.2)
        if self.is_ready:
            self.close_channel()
        return self.is_ready

    def close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def close(self) -> None:
        self.close_channel()
        self.process.close()


class GrammarSupervisor:
    def __init__(self, extra_args: tuple[str, ...] = (), *, min_backoff_s: float = 0.5,
                 max_backoff_s: float = 10.0, standby: bool = True):
        self._extra_args = extra_args
        self._min_backoff_s, self._max_backoff_s = min_backoff_s, max_backoff_s
        self._backoff_s = min_backoff_s
        self._folder = tempfile.mkdtemp(prefix="structgen-grammar-")  # 0700
        self.socket_path = os.path.join(self._folder, "grammar.sock")
        self._standby_path = os.path.join(self._folder, "standby.sock")
        self._grammars_dir = os.path.join(self._folder, "grammars")
        self._use_standby = standby
        self._lifeline_read, self._lifeline_write = os.pipe()  # not inherited: only the template gets it
        self._template: GrammarTemplate | None = None
        self._serving: _Child | None = None  # None between its exit and its successor
        self._standby: _Child | None = None
        self._next_fork_s = 0.0  # monotonic time before which no child is forked (backoff)
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.num_restarts = 0
        self.num_takeovers = 0  # restarts served by the warm standby
        self._tokenizer_args: tuple[str, ...] = ()

    def use_tokenizer(self, tokenizer_dir: str, vocab_size: int) -> None:
        """The tokenizer every child forked from now on preloads: a child taking over must
        compile before the engine has re-opened its channel."""
        self._tokenizer_args = ("--tokenizer-dir", str(tokenizer_dir), "--vocab-size", str(vocab_size))

    @property
    def address(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        serving = self._serving
        return serving.pid if serving is not None else None

    @property
    def standby_pid(self) -> int | None:
        """The warm standby's pid once it reports SERVING, else None."""
        standby = self._standby
        return standby.pid if standby is not None and standby.is_ready else None

    # ---- the template and its children ---------------------------------------------------------
    def spawn(self) -> None:
        """Start the template without waiting for it (its imports overlap the caller's start-up)."""
        env = dict(os.environ)
        if env.get("OTEL_SERVICE_NAME"):  # its spans show as a second service, as in the chart
            env["OTEL_SERVICE_NAME"] += "-grammar"
        env["TMPDIR"] = self._folder  # whatever temporary files it leaves, stop() removes
        self._template = GrammarTemplate.spawn(env, self._lifeline_read, _die_with_parent(os.getpid()))

    def _spawn(self, path: str, extra_args: tuple[str, ...] = (),
               should_stop: Callable[[], bool] = lambda: False) -> _Child:
        """Fork a child listening on `path`; raises TemplateError."""
        if os.path.exists(path):
            os.unlink(path)  # a crashed child leaves its socket behind
        argv = ("--listen", f"unix://{path}", "--shared-grammars-dir", self._grammars_dir,
                *self._extra_args, *self._tokenizer_args, *extra_args)
        return _Child(self._template.fork(argv, FORK_TIMEOUT_S, should_stop), path)

    def start(self, ready_timeout_s: float = 120.0, should_stop: Callable[[], bool] = lambda: False) -> None:
        """`spawn()` then `wait_ready()`."""
        self.spawn()
        self.wait_ready(ready_timeout_s, should_stop)

    def wait_ready(self, ready_timeout_s: float = 120.0, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Fork the serving child and wait until it reports SERVING (or `should_stop()`: then the
        children are stopped again and this returns; the caller checks its own stop condition)."""
        try:
            self._serving = self._spawn(self.socket_path, should_stop=should_stop)
        except TemplateError as error:
            self.stop()
            if should_stop():
                return
            raise RuntimeError(f"grammar_service did not start: {error}") from None
        self._serving.is_ready = wait_healthy(self.address, ready_timeout_s, self._serving.process, should_stop)
        if not self._serving.is_ready:
            exited = self._serving.process.has_exited()
            self.stop()
            if should_stop():
                return
            raise RuntimeError("grammar_service exited before it was healthy" if exited
                               else f"grammar_service did not become healthy within {ready_timeout_s} s")
        self._serving.close_channel()
        self._watcher = threading.Thread(target=self._watch, name="grammar-supervisor", daemon=True)
        self._watcher.start()

    # ---- the watcher thread: every fork after the first happens here ---------------------------
    def _watch(self) -> None:
        while not self._stopping.wait(0.01):  # one pidfd poll per child: the takeover waits on it
            try:
                self._tend()
            except TemplateError as error:
                if self._template.has_exited():
                    log.error("the grammar template is gone (%s); starting another", error)
                    self._restart_template()
                else:
                    log.error("grammar_service could not be forked: %s", error)
                    self._back_off()

    def _tend(self) -> None:
        """One look at the template and the children: replace what ended, fork what is missing."""
        if self._template.has_exited():
            raise TemplateError(f"it exited with {self._template.process.returncode}")
        if self._serving is not None and self._serving.process.has_exited():
            self._on_serving_exit()
        self._tend_standby()
        serving = self._serving
        if serving is not None and serving.became_ready():
            self._backoff_s = self._min_backoff_s
        if time.monotonic() < self._next_fork_s:
            return
        if self._serving is None and self._standby is None:  # none to wait for: a child in its place
            self._serving = self._spawn(self.socket_path)
            self.num_restarts += 1
        elif self._use_standby and self._standby is None and self._serving.is_ready:
            # its metrics port (the serving child's until then) is bound once it takes over
            self._standby = self._spawn(self._standby_path)

    def _tend_standby(self) -> None:
        standby = self._standby
        if standby is None:
            return
        if standby.process.has_exited():
            log.warning("grammar_service standby (pid %d) exited", standby.pid)
            self._standby = None
            standby.close()
            if not standby.is_ready:
                self._back_off()
        elif standby.became_ready():
            self._backoff_s = self._min_backoff_s
            log.info("grammar_service standby (pid %d) is ready to take over", standby.pid)
            if self._serving is None:
                self._take_over()
                log.warning("grammar_service standby (pid %d) took over", standby.pid)

    def _on_serving_exit(self) -> None:
        exited, self._serving = self._serving, None
        exited.close()
        if not exited.is_ready:
            self._back_off()
        standby = self._standby
        if standby is not None and standby.is_ready:
            self._take_over()
            log.warning("grammar_service (pid %d) exited; its warm standby (pid %d) took over", exited.pid, standby.pid)
        elif standby is not None:
            log.warning("grammar_service (pid %d) exited; its standby (pid %d) takes over once ready",
                        exited.pid, standby.pid)
        else:
            log.warning("grammar_service (pid %d) exited; forking another", exited.pid)

    def _take_over(self) -> None:
        """Move the ready standby onto the serving socket."""
        self._serving, self._standby = self._standby, None
        os.replace(self._standby_path, self.socket_path)  # the listening socket follows its file
        self.num_takeovers += 1
        self.num_restarts += 1

    def _back_off(self) -> None:
        """A child ended before it was ready: the next waits, longer each time in a row."""
        self._next_fork_s = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)

    def _restart_template(self) -> None:
        self._template.stop(1.0)
        self._back_off()
        if not self._stopping.wait(max(0.0, self._next_fork_s - time.monotonic())):
            self.spawn()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the children (SIGTERM, then SIGKILL after timeout_s) and the template, and
        remove the folder."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(timeout_s)  # no fork races the terminations below
        children = [child for child in (self._serving, self._standby) if child is not None]
        for child in children:
            child.process.signal(signal.SIGTERM)
        for child in children:  # one that never served has nothing to drain
            child.process.stop(timeout_s if child.is_ready else min(timeout_s, 1.0))
            child.close()
        self._serving = self._standby = None
        if self._template is not None:
            self._template.stop(timeout_s)
        for fd in (self._lifeline_read, self._lifeline_write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._lifeline_read = self._lifeline_write = -1
        shutil.rmtree(self._folder, ignore_errors=True)
