"""/metrics of a grammar_service process, including a warm standby's under `structgen serve`.

A standby (structgen/supervisor.py) starts while the serving child holds the metrics port. It
binds the port once it has taken over: the supervisor then moves its listening socket onto the
serving path, so the file at its own path is no longer its socket. A process that does not
listen on a Unix socket cannot be a standby: a port in use is an error there, as before.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time

import prometheus_client

log = logging.getLogger(__name__)
POLL_S = 0.1  # a takeover's metrics are served this soon after it (or after the replaced child let go of the port)


def serve_metrics(port: int, socket_path: str | None, socket_inode: int | None) -> None:
    """Serve /metrics on `port` now, or (a Unix-socket process whose port is in use) once this
    process's socket has been moved off `socket_path`."""
    try:
        prometheus_client.start_http_server(port)
        return
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE or not socket_path:
            raise
    log.info("metrics port %d is in use (the serving child's while this one stands by); "
             "serving /metrics once this process serves", port)
    threading.Thread(target=_bind_after_move, args=(port, socket_path, socket_inode),
                     name="metrics-after-takeover", daemon=True).start()


def _bind_after_move(port: int, socket_path: str, socket_inode: int | None) -> None:
    while True:
        time.sleep(POLL_S)
        try:
            if os.stat(socket_path).st_ino == socket_inode:
                continue  # still standing by
        except FileNotFoundError:
            pass
        try:
            prometheus_client.start_http_server(port)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                continue
            log.warning("cannot serve /metrics on port %d: %s", port, exc)
            return
        log.info("serving /metrics on port %d", port)
        return
