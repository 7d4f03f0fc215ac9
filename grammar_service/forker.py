"""WorkerForker: a copy of grammar_service, made before it has threads or gRPC objects, that
forks compile workers on request.

A worker forked from it starts with the backends imported and the tokenizer loaded (when it
was loaded before the forker started), so it is ready in milliseconds; multiprocessing's
forkserver started a fresh interpreter that imported everything again (seconds) and each worker
then loaded the tokenizer (seconds at 131k). Forking grammar_service itself later would copy
its gRPC threads' locks, hence a copy made early.

It speaks over a socketpair, one request at a time (multiprocessing.connection framing):
`("spawn", target, args)` -> `("spawned", pid)` and the worker's end of a new socketpair passed
as a file descriptor; the worker runs `target(connection, *args)` and exits.
`("status", pid)` -> `("status", exit code or None)`: the forker reaps its workers at once
(SIGCHLD) and keeps the exit codes of the last few. It dies with grammar_service
(PR_SET_PDEATHSIG) and on the end of its socket.
"""
from __future__ import annotations

import collections
import ctypes
import os
import signal
import socket
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Callable

from structgen.process_handle import ProcessHandle, reap_children

_PR_SET_PDEATHSIG = 1
_NUM_STATUSES = 256  # exit codes kept for `exit_code`


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """`signum` when the parent goes (Linux), or exit now if it already has."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


class ForkedWorker:
    """A worker the forker started: the process (not this process's child) and its connection."""

    def __init__(self, pid: int, conn: Connection, forker: "WorkerForker"):
        self.pid, self.conn, self._forker = pid, conn, forker
        self._handle = ProcessHandle(pid)

    def is_alive(self) -> bool:
        return not self._handle.has_exited()

    def join(self, timeout_s: float) -> None:
        self._handle.wait(timeout_s)

    def kill(self) -> None:
        self._handle.signal(signal.SIGKILL)

    @property
    def exitcode(self) -> int | None:
        """As multiprocessing reports it: -N for a signal, None while it runs."""
        return self._forker.exit_code(self.pid) if self._handle.has_exited() else None

    def close(self) -> None:
        self.conn.close()
        self._handle.close()


class WorkerForker:
    def __init__(self, pid: int, conn: Connection):
        self.pid, self._conn = pid, conn
        self._lock = threading.Lock()  # one request at a time

    @classmethod
    def start(cls) -> "WorkerForker":
        """Fork the forker now. NOTE: call while this process has no other thread."""
        ours, theirs = socket.socketpair()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            ours.close()
            # NOTE: only its own socket: a descriptor inherited from this process (another
            # forker's socket, a channel's) would keep that open past its owner's close
            os.closerange(3, theirs.fileno())
            os.closerange(theirs.fileno() + 1, os.sysconf("SC_OPEN_MAX"))
            _serve(Connection(theirs.detach()), parent)  # never returns
        theirs.close()
        return cls(pid, Connection(ours.detach()))

    def spawn(self, target: Callable, args: tuple) -> ForkedWorker:
        with self._lock:
            self._conn.send(("spawn", target, args))
            reply = self._conn.recv()
            fd = recv_handle(self._conn)
        return ForkedWorker(reply[1], Connection(fd), self)

    def exit_code(self, pid: int) -> int | None:
        try:
            with self._lock:
                self._conn.send(("status", pid))
                return self._conn.recv()[1]
        except (EOFError, OSError):
            return None

    def close(self) -> None:
        """The forker exits on the end of its socket (its workers with it, PR_SET_PDEATHSIG)."""
        self._conn.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _serve(conn: Connection, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    signal.set_wakeup_fd(-1)  # grammar_service's (StopSignals), closed here
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches grammar_service, which stops us
    statuses: collections.OrderedDict[int, int] = collections.OrderedDict()

    def reap(*_) -> None:
        statuses.update(reap_children())
        while len(statuses) > _NUM_STATUSES:
            statuses.popitem(last=False)

    signal.signal(signal.SIGCHLD, reap)
    try:
        while True:
            request = conn.recv()
            if request[0] == "status":
                reap()
                conn.send(("status", statuses.get(request[1])))
            else:
                _spawn(conn, *request[1:])
    except (EOFError, OSError):
        pass
    os._exit(0)


def _spawn(conn: Connection, target: Callable, args: tuple) -> None:
    ours, theirs = socket.socketpair()
    forker_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        # a runaway compile never reads its socket, so its end cannot stop it: the forker's can
        die_with_parent(forker_pid)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        conn.close()
        ours.close()
        try:
            target(Connection(theirs.detach()), *args)
        except BaseException:  # noqa: BLE001 -- a worker's end: say why, as multiprocessing does
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    theirs.close()
    conn.send(("spawned", pid))
    send_handle(conn, ours.fileno(), pid)
    ours.close()
