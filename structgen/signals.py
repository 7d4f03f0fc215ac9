"""SIGTERM / SIGINT as a flag and a pipe, without the race of `signal` + `threading.Event`.

`signal.signal(sig, lambda *_: event.set())` then `event.wait()` can hang: the Python handler
runs in the main thread between bytecodes, possibly while that thread holds the Event's
internal lock inside `wait()`, and `set()` then waits for that lock forever. Here the handler
only stores the signal number (no lock), and the C-level handler writes a byte to a pipe
(`signal.set_wakeup_fd`) before any Python code runs, so a signal that arrives before `wait()`
still wakes it. Install it first thing in `main`, before any resource is created; start-up
code polls `is_set` between steps so a signal during start-up cleans up and exits.
"""
from __future__ import annotations

import os
import select
import signal
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Created in the main thread; `wait` is called from the main thread."""

    def __init__(self, signums: tuple[int, ...] = STOP_SIGNALS):
        self.received: int | None = None
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # the C handler must never block
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for signum in signums:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        # NOTE: no lock, no I/O, no logging: this interrupts arbitrary code of the main thread.
        self.received = signum

    @property
    def is_set(self) -> bool:
        return self.received is not None

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until a stop signal has arrived (True) or timeout_s passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.received is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            readable, _, _ = select.select([self._read_fd], [], [], remaining)
            if readable:  # the handler has run by the time select returns to Python code
                os.read(self._read_fd, 512)
        return True
