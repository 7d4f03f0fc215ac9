"""Ports for test servers: below the kernel's ephemeral range, so no outgoing connection takes
a port between the test picking it and the server binding it; each handed out once per process."""
from __future__ import annotations

import os
import pathlib
import random
import socket


def _ephemeral_start() -> int:
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORT_RANGE = range(10000, max(_ephemeral_start(), 20000))
_PORTS = iter(random.Random(os.getpid()).sample(_PORT_RANGE, len(_PORT_RANGE)))


def free_port() -> int:
    """A port nothing listens on now (for flags whose 0 means off)."""
    for port in _PORTS:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port left below the ephemeral range")
