"""The grammar template: grammar_service's slow start-up done once, then forked per child.

`structgen serve`'s supervisor starts it (`python -m grammar_service.template --control-fd N
--lifeline-fd M`) and asks it for grammar_service children (structgen/grammar_template.py: a
`ForkRequest` holds a child's flags). For each it resolves the flags as `structgen grammar` does,
runs `server.prepare` (the imports once; each tokenizer once, from the on-disk cache where it
can) and forks: the child leads a session of its own, runs `server.run` and is ready in a
fraction of a second, where a fresh process spends 5-30 s on the same two busy CPUs importing
torch (xgrammar needs it), loading the tokenizer and starting its compile workers
(docs/grammar_service.md, "Start-up").

Forking is safe because the template never has a second thread or a gRPC object (it imports
grpc, which starts nothing) and freezes its heap before each fork, so the children share its
pages instead of copying them on the collector's first pass.

Lifetimes: the template exits at the end of its control connection (the supervisor's stop) and
with serve (PR_SET_PDEATHSIG, set by the supervisor); it reaps its children and logs how each
ended. Children do not die with it: they stop at the end of the lifeline, a pipe only serve
writes to, so a template that crashes leaves the service serving while the supervisor starts
another.
"""
from __future__ import annotations

from structgen.cli import disable_grpc_fork_handlers

disable_grpc_fork_handlers()  # NOTE: before grammar_service.server imports grpc

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from multiprocessing.connection import Connection  # noqa: E402

from grammar_service.config import GrammarServiceConfig  # noqa: E402
from grammar_service.server import build_parser, exit_now, prepare, preload_backends, run  # noqa: E402
from grammar_service.settings import GRAMMAR_SETTINGS  # noqa: E402
from structgen.grammar_template import ForkFailed, Forked, ForkRequest  # noqa: E402
from structgen.heap import freeze_heap  # noqa: E402
from structgen.process_handle import reap_children  # noqa: E402
from structgen.settings import ProcessConfig, SettingsError  # noqa: E402
from structgen.signals import StopSignals  # noqa: E402

log = logging.getLogger("grammar_service.template")
LOG_FORMAT = "%(asctime)s %(levelname)s grammar_service %(name)s: %(message)s"


def _reap(*_) -> None:
    """SIGCHLD: reap every child that ended and say how (the supervisor sees only that it did)."""
    for pid, code in reap_children():
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        (log.info if code == 0 else log.warning)("grammar_service child %d ended (%s)", pid, how)


def fork_child(request: ForkRequest, lifeline_fd: int, conn: Connection) -> Forked | ForkFailed:
    try:
        resolved = GRAMMAR_SETTINGS.resolve(build_parser().parse_args(request.argv), os.environ)
    except (SettingsError, SystemExit) as error:
        return ForkFailed(f"bad grammar_service flags {request.argv}: {error}")
    config = resolved[GrammarServiceConfig]
    started = time.monotonic()
    try:
        prepare(config)
    except Exception as error:  # noqa: BLE001 -- the child would fail the same way: say why here
        return ForkFailed(f"cannot prepare grammar_service: {error!r}")
    if time.monotonic() - started > 0.1:  # it loaded something: collect its garbage once
        log.info("tokenizer %s prepared in %.2f s", config.tokenizer_dir, time.monotonic() - started)
        freeze_heap()
    gc.freeze()  # the children share these pages instead of copying them on their first collection
    pid = os.fork()
    if pid == 0:
        _child(resolved, lifeline_fd, conn)
    return Forked(pid)


def _child(resolved, lifeline_fd: int, conn: Connection) -> None:
    """The forked grammar_service; never returns."""
    try:
        os.setsid()  # its process group holds its forker and workers: one killpg cleans up
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        conn.close()
        stop = StopSignals()
        logging.getLogger().setLevel(resolved[ProcessConfig].log_level.upper())
        for warning in resolved.warnings:
            log.warning("%s", warning)
        log.info("settings: %s", json.dumps(resolved.as_dict(), sort_keys=True))
        run(resolved[GrammarServiceConfig], stop, lifeline_fd=lifeline_fd)
    except BaseException:  # noqa: BLE001 -- never back into the template's loop
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    exit_now()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m grammar_service.template")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--lifeline-fd", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        level = GRAMMAR_SETTINGS.resolve(build_parser().parse_args([]), os.environ)[ProcessConfig].log_level
    except SettingsError:  # each child reports it
        level = "INFO"
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    conn = Connection(args.control_fd)
    signal.signal(signal.SIGCHLD, _reap)
    started = time.monotonic()
    preload_backends()  # the first request (the serving child) waits for this anyway
    log.info("grammar template (pid %d) ready to fork after %.2f s of imports", os.getpid(),
             time.monotonic() - started)
    freeze_heap()
    try:
        while True:
            conn.send(fork_child(conn.recv(), args.lifeline_fd, conn))
    except (EOFError, OSError):  # the supervisor closed the connection, or is gone
        pass
    exit_now()


if __name__ == "__main__":
    main()
