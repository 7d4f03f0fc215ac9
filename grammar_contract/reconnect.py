"""ReconnectGuard: a call made while grammar_service is unreachable waits a bounded time for it.

The control client makes its calls with gRPC's wait_for_ready, so a call made while
grammar_service restarts (a standby taking over, a sidecar restarted) waits for the process
that takes its place instead of failing at once; gRPC's own deadline would bound the call's
whole work too (a compile's seconds), so this guard cancels a call that is still waiting for a
connection `wait_s` after it was made. It follows the channel's connectivity; calls made
while the channel is connected are not watched. One thread waits, only while calls are held.
"""
from __future__ import annotations

import threading
import time

import grpc


class ReconnectGuard:
    def __init__(self, channel: grpc.Channel, wait_s: float):
        self._channel, self._wait_s = channel, wait_s
        self._is_ready = threading.Event()
        self._lock = threading.Lock()
        self._held: list[tuple[float, grpc.Future]] = []  # (deadline, call)
        self._waiter: threading.Thread | None = None
        channel.subscribe(self._on_state, try_to_connect=True)

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.READY:
            self._is_ready.set()
        else:
            self._is_ready.clear()

    def guard(self, call: grpc.Future) -> None:
        """Cancel `call` if the channel is not connected within `wait_s`."""
        if self._is_ready.is_set():
            return
        with self._lock:
            self._held.append((time.monotonic() + self._wait_s, call))
            if self._waiter is None:
                self._waiter = threading.Thread(target=self._watch, name="grammar-reconnect", daemon=True)
                self._waiter.start()

    def _watch(self) -> None:
        while True:
            with self._lock:
                if not self._held:
                    self._waiter = None
                    return
                first_deadline = min(deadline for deadline, _ in self._held)
            is_ready = self._is_ready.wait(max(0.0, first_deadline - time.monotonic()))
            now = time.monotonic()
            with self._lock:
                expired = [] if is_ready else [call for deadline, call in self._held if deadline <= now]
                self._held = [] if is_ready else [(d, call) for d, call in self._held if d > now]
            for call in expired:
                call.cancel()  # no-op for a call that ended meanwhile

    def close(self) -> None:
        self._channel.unsubscribe(self._on_state)
        with self._lock:
            held, self._held = self._held, []
        for _, call in held:
            call.cancel()
