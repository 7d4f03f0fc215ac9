"""The grammar template as `structgen serve`'s supervisor drives it, and what both say.

The template (grammar_service/template.py) is a process that has done grammar_service's slow
start-up once and forks ready grammar_service children on request. Over a socketpair
(multiprocessing.connection framing) the supervisor sends a `ForkRequest` (a child's flags, as
`structgen grammar` takes them) and gets `Forked` (its pid) or `ForkFailed` (why), one request
at a time. The template ends at the end of that connection.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable

from structgen.process_handle import ProcessHandle


@dataclass(frozen=True)
class ForkRequest:
    argv: tuple[str, ...]


@dataclass(frozen=True)
class Forked:
    pid: int


@dataclass(frozen=True)
class ForkFailed:
    message: str


class TemplateError(Exception):
    """The template is gone, or could not fork the child asked for."""


class GrammarTemplate:
    def __init__(self, process: subprocess.Popen, conn: Connection):
        self.process, self._conn = process, conn
        self._lock = threading.Lock()

    @classmethod
    def spawn(cls, env: dict[str, str], lifeline_fd: int, preexec_fn: Callable[[], None]) -> "GrammarTemplate":
        """Start the template; it imports while the caller goes on (fork requests wait for it).
        `lifeline_fd`: the read end of a pipe only the caller writes to, inherited by every
        child (they stop at its end)."""
        ours, theirs = socket.socketpair()
        argv = [sys.executable, "-m", "grammar_service.template", "--control-fd", str(theirs.fileno()),
                "--lifeline-fd", str(lifeline_fd)]
        try:
            # NOTE: a session of its own, and so its children: Ctrl-C in a terminal (SIGINT to
            # the foreground group) must not stop them while serve still drains through them.
            process = subprocess.Popen(argv, pass_fds=(theirs.fileno(), lifeline_fd), preexec_fn=preexec_fn,
                                       env=env, start_new_session=True)
        finally:
            theirs.close()
        return cls(process, Connection(ours.detach()))

    def fork(self, argv: tuple[str, ...], timeout_s: float,
             should_stop: Callable[[], bool] = lambda: False) -> ProcessHandle:
        """A new grammar_service child with these flags; raises TemplateError (also once
        `should_stop()` is true while the template is still importing or loading a tokenizer)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            try:
                self._conn.send(ForkRequest(tuple(argv)))
                while not self._conn.poll(0.05):
                    if should_stop() or time.monotonic() > deadline or self.has_exited():
                        self.process.kill()  # a late answer would be taken for the next request's
                        raise TemplateError(f"the grammar template did not fork within {timeout_s:.0f} s"
                                            if not should_stop() else "stopped while the template started")
                reply = self._conn.recv()
            except (EOFError, OSError) as error:
                raise TemplateError(f"the grammar template is gone (exit code {self.process.poll()})") from error
        if isinstance(reply, ForkFailed):
            raise TemplateError(reply.message)
        return ProcessHandle(reply.pid)

    def has_exited(self) -> bool:
        return self.process.poll() is not None

    def stop(self, timeout_s: float = 5.0) -> None:
        """End its connection (it exits at once), then SIGKILL after `timeout_s`."""
        self._conn.close()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

