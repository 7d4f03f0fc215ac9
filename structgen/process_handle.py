"""ProcessHandle: watch and stop a process that need not be this process's child.

grammar_service children are forked by the grammar template (grammar_service/template.py) and
compile workers by a worker forker (grammar_service/forker.py), so the process that starts them
cannot waitpid() them. A pidfd (Linux 5.3+) becomes readable when the process exits, whoever
its parent is; where there is none, `os.kill(pid, 0)` is asked instead, which is exact as long
as the parent reaps its children at once (both forkers do, on SIGCHLD).
"""
from __future__ import annotations

import os
import select
import signal
import time


class ProcessHandle:
    def __init__(self, pid: int):
        self.pid = pid
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already
            self._pidfd, self._exited = None, True
            return
        except (AttributeError, OSError):  # no pidfd here (older kernel, not Linux)
            self._pidfd = None
        self._exited = False

    def has_exited(self) -> bool:
        return self.wait(0.0)

    def wait(self, timeout_s: float) -> bool:
        """True once the process has exited, else False after `timeout_s`."""
        if self._exited:
            return True
        if self._pidfd is not None:
            readable, _, _ = select.select([self._pidfd], [], [], max(0.0, timeout_s))
            self._exited = bool(readable)
            return self._exited
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._exited = True
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))

    def signal(self, signum: int) -> None:
        if self._exited:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signum)  # never another process of a reused pid
            else:
                os.kill(self.pid, signum)
        except (ProcessLookupError, OSError):
            pass

    def stop(self, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; then SIGKILL to what is left of its process
        group (a child that leads its own session: its workers)."""
        self.signal(signal.SIGTERM)
        if not self.wait(timeout_s):
            self.signal(signal.SIGKILL)
            self.wait(5.0)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def reap_children() -> list[tuple[int, int]]:
    """(pid, exit code as multiprocessing gives it: -N for signal N) of every child of this
    process that has ended, reaped now (a SIGCHLD handler's work)."""
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))
