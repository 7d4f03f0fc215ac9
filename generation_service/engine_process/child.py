"""The engine process: loads the model, runs the Engine, forwards its events to the serving
process (proxy.RemoteEngine starts it with `multiprocessing`'s spawn, so no CUDA state is
inherited).

Its main thread reads the pipe (submit, cancel, calls, stop); the engine loop only appends
events to the `Outbox`, whose thread pickles and sends what has gathered in one message, so a
step's 128 token events cost the loop 128 appends. It ignores SIGINT and SIGTERM (the serving
process drains and then sends STOP) and dies with the serving process: the kernel sends it
SIGKILL when that process's thread that started it ends (PR_SET_PDEATHSIG), and a closed
pipe stops the engine too.
"""
from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import sys
import threading

from generation_service.engine.events import FinishReason, OutputEvent
from generation_service.engine.stream import RequestStream
from generation_service.engine_process.wire import (CALL, CANCEL, FAILED, FINISHED, ITEMS, LOADED, REPLY, STOP,
                                                     STOPPED, SUBMIT, EngineInfo, FinishedRequest, Sender, item_of)
from grammar_contract.errors import StatusError

log = logging.getLogger("structgen.engine_process")

CALLS = ("start", "stats")  # the Engine methods the serving process may call
_PR_SET_PDEATHSIG = 1


class Outbox:
    """Items for the serving process, sent by a thread of their own: whatever has gathered when
    it wakes goes as one message. `add` and `signal` from any thread."""

    def __init__(self, sender: Sender) -> None:
        self._sender = sender
        self._items: collections.deque = collections.deque()
        self._ready = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def add(self, item: tuple) -> None:
        self._items.append(item)

    def signal(self) -> None:
        if not self._ready.is_set():
            self._ready.set()

    def _run(self) -> None:
        items = self._items
        while True:
            self._ready.wait()
            self._ready.clear()  # NOTE: before the items are taken: a later add signals again
            if items:
                self._sender.send((ITEMS, [items.popleft() for _ in range(len(items))]))
            if self._closed and not items:
                return

    def close(self) -> None:
        """Send what is left, then stop the thread."""
        self._closed = True
        self._ready.set()
        self._thread.join(timeout=10)


class ForwardedStream(RequestStream):
    """The engine's stream of a request that the serving process consumes: events go to the
    outbox; the consumer (and its cancel) is over there."""

    def __init__(self, request_id: str, outbox: Outbox) -> None:
        super().__init__(request_id, cancel=lambda _: None)
        self._outbox = outbox

    def push(self, event: OutputEvent) -> None:
        self.is_finished = self.is_finished or event.is_final
        self._outbox.add(item_of(self.request_id, event))

    def wake(self) -> None:
        self._outbox.signal()


def main(conn, engine_config, grammar_address: str | None, log_level: str, switch_interval_s: float) -> None:
    """The engine process's entry point (multiprocessing target)."""
    _detach()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from structgen import telemetry
    telemetry.setup("structgen")  # compile spans and the request spans are made here
    telemetry.install_log_correlation()
    sys.setswitchinterval(switch_interval_s)
    sender = Sender(conn)
    try:
        engine = _load(engine_config, grammar_address)
    except BaseException as error:  # noqa: BLE001 -- reported to the serving process, which raises it
        _send_failure(sender, error)
        os._exit(1)
    outbox = Outbox(sender)
    engine.table.finish_listeners.append(
        lambda request: outbox.add((FINISHED, request.request_id, FinishedRequest.of(request))))
    sender.send((LOADED, EngineInfo(engine.config, engine.model_config, engine.tokenizer, engine.model_name,
                                    engine.runner_name, engine.limits)))
    from structgen.heap import freeze_heap
    freeze_heap()
    _serve(conn, engine, outbox)
    try:
        sender.send((STOPPED,))
    except OSError:  # the serving process is gone
        pass
    telemetry.shutdown()
    os._exit(0)  # NOTE: the engine is stopped and its channel unlinked; finalization takes seconds


def _load(engine_config, grammar_address: str | None):
    from generation_service.engine.engine import Engine
    from grammar_contract.client import GrammarControlClient
    return Engine(engine_config, GrammarControlClient(grammar_address) if grammar_address else None)


def _serve(conn, engine, outbox: Outbox) -> None:
    """Apply the serving process's messages until STOP (or until its end of the pipe closes)."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the serving process is gone: nobody reads the events
            log.warning("the serving process closed the pipe; stopping the engine")
            engine.stop(0)
            outbox.close()
            return
        kind = message[0]
        if kind == SUBMIT:
            _submit(engine, outbox, message[1])
        elif kind == CANCEL:
            engine.cancel(message[1])
        elif kind == CALL:
            _call(engine, outbox, message[1], message[2])
        elif kind == STOP:
            engine.stop(message[1])
            outbox.close()
            return


def _submit(engine, outbox: Outbox, spec) -> None:
    try:
        engine.submit(spec, ForwardedStream(spec.request_id, outbox))
    except StatusError as error:  # the serving process's stream ends with it, as a raise would
        outbox.add(item_of(spec.request_id, OutputEvent(finish_reason=FinishReason.ERROR, error=error)))
        outbox.signal()


def _call(engine, outbox: Outbox, call_id: int, method: str) -> None:
    try:
        if method not in CALLS:
            raise ValueError(f"the engine process has no call {method!r}")
        outbox.add((REPLY, call_id, getattr(engine, method)(), None))
    except Exception as error:  # noqa: BLE001 -- raised in the caller
        outbox.add((REPLY, call_id, None, error))
    outbox.signal()


def _send_failure(sender: Sender, error: BaseException) -> None:
    try:
        sender.send((FAILED, error))
    except Exception:  # noqa: BLE001 -- an error that does not pickle goes as its text
        sender.send((FAILED, RuntimeError(f"{type(error).__name__}: {error}")))


def _detach() -> None:
    """Signals are the serving process's; die with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        import multiprocessing
        parent = multiprocessing.parent_process()
        if parent is not None and os.getppid() != parent.pid:  # it died before the line above
            os._exit(1)
