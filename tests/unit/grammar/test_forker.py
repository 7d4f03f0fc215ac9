"""WorkerForker (grammar_service/forker.py): compile workers forked from an early copy of this
process, watched without being its children, gone with the forker."""
from __future__ import annotations

import os
import signal

from grammar_service.forker import WorkerForker

LOADED_BEFORE_THE_FORKER = {"value": "inherited"}


def _echo(conn, suffix: str) -> None:
    conn.send(("ready", os.getpid(), os.getppid(), LOADED_BEFORE_THE_FORKER["value"]))
    while True:
        conn.send(conn.recv() + suffix)


def _crash(conn) -> None:
    conn.send("about to crash")
    os.kill(os.getpid(), signal.SIGSEGV)


def test_workers_start_with_what_this_process_had_and_report_how_they_ended():
    forker = WorkerForker.start()
    LOADED_BEFORE_THE_FORKER["value"] = "changed after the forker started"
    try:
        worker = forker.spawn(_echo, ("!",))
        ready, pid, parent, value = worker.conn.recv()
        assert (ready, pid, parent, value) == ("ready", worker.pid, forker.pid, "inherited")
        worker.conn.send("hi")
        assert worker.conn.recv() == "hi!"
        assert worker.is_alive() and worker.exitcode is None
        crashing = forker.spawn(_crash, ())
        assert crashing.conn.recv() == "about to crash"
        crashing.join(10)
        assert not crashing.is_alive() and crashing.exitcode == -signal.SIGSEGV
        worker.kill()
        worker.join(10)
        assert worker.exitcode == -signal.SIGKILL
    finally:
        LOADED_BEFORE_THE_FORKER["value"] = "inherited"
        forker.close()


def test_workers_go_with_the_forker():
    forker = WorkerForker.start()
    worker = forker.spawn(_echo, ("",))
    assert worker.conn.recv()[0] == "ready"
    forker.close()  # its socket ends, it exits, PR_SET_PDEATHSIG ends the worker
    worker.join(10)
    assert not worker.is_alive()
