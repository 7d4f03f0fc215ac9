"""RemoteEngine: the Engine as the serving process's edges see it, run in the engine process.

It has what the edges use of an Engine (`submit`, `cancel`, `stats`, `start`, `stop`,
`tokenizer`, `config`, `model_config`, `model_name`, `runner_name`, `limits`,
`table.finish_listeners`), so the gRPC servicer, the HTTP API, metrics and tracing run
unchanged over it. `submit` checks the request against the engine's limits here (the caller
gets the same error at once) and returns a RequestStream at once; the engine's own refusals
(a full queue, a request id in use) come back as the stream's final event with the error,
which the edges raise as they would the call's. A thread reads the pipe: each message's
token events are pushed to their streams and the streams woken once, as the engine loop does
in-process. Finish listeners get a `wire.FinishedRequest` with the fields they read.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
from concurrent.futures import Future
from typing import Callable

from generation_service.engine.errors import EngineError, InvalidRequestError, ShuttingDownError
from generation_service.engine.events import FinishReason, OutputEvent
from generation_service.engine.params import GenerationRequest
from generation_service.engine.stream import RequestStream
from generation_service.engine.validation import validate_request
from generation_service.engine_process import child
from generation_service.engine_process.wire import (CALL, CANCEL, EVENT, FAILED, FINISHED, ITEMS, REPLY, STOP,
                                                     STOPPED, SUBMIT, TOKENS, EngineInfo, Sender)

log = logging.getLogger("structgen.engine_process")

_START_TIMEOUT_S = 600.0  # the engine's start (channel, graph capture of the channel's variants)


class EngineProcessError(EngineError):
    """The engine process failed to start or exited."""

    status = "UNAVAILABLE"


class _Table:
    """`engine.table` as the edges use it: the finish listeners."""

    def __init__(self) -> None:
        self.finish_listeners: list[Callable] = []


class RemoteEngine:
    def __init__(self, process, conn, info: EngineInfo) -> None:
        self._process = process
        self._conn = conn
        self._sender = Sender(conn)
        self.config = info.config
        self.model_config = info.model_config
        self.tokenizer = info.tokenizer
        self.model_name = info.model_name
        self.runner_name = info.runner_name
        self.limits = info.limits
        self.table = _Table()
        self.on_exit: Callable[[str], None] | None = None  # the engine process ended unasked: why
        self.failure: str | None = None
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._is_accepting = True
        self._is_stopping = False
        self._stopped = threading.Event()
        self._receiver = threading.Thread(target=self._receive, name="engine-events", daemon=True)
        self._receiver.start()

    @classmethod
    def spawn(cls, engine_config, grammar_address: str | None, log_level: str, switch_interval_s: float,
              check_stop: Callable[[], None] = lambda: None) -> "RemoteEngine":
        """Start the engine process and wait until its model is loaded. `check_stop` is called
        while it loads; what it raises stops the process and propagates. An error of the load
        (a missing model, ...) is raised here as the engine raised it."""
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        process = context.Process(target=child.main, name="structgen-engine",
                                  args=(child_conn, engine_config, grammar_address, log_level, switch_interval_s))
        process.start()
        child_conn.close()
        try:
            while not conn.poll(0.05):
                check_stop()
                if not process.is_alive():
                    raise EngineProcessError(f"the engine process exited while loading (exit code {process.exitcode})")
            message = conn.recv()
        except BaseException:
            process.kill()
            process.join(10)
            raise
        if message[0] == FAILED:
            process.join(10)
            raise message[1]
        log.info("engine process %d: model loaded", process.pid)
        return cls(process, conn, message[1])

    # ---- what the edges call ----------------------------------------------------------------
    def start(self) -> None:
        self._call("start", _START_TIMEOUT_S)

    def stats(self):
        return self._call("stats", 30.0)

    def submit(self, spec: GenerationRequest) -> RequestStream:
        if not self._is_accepting:
            raise ShuttingDownError("the engine is shutting down" if self.failure is None else self.failure)
        validate_request(spec, self.limits)
        if spec.request_id in self._streams:
            raise InvalidRequestError(f"request_id {spec.request_id!r} is already in use")
        stream = RequestStream(spec.request_id, self.cancel)
        self._streams[spec.request_id] = stream  # NOTE: before the engine can answer
        try:
            self._sender.send((SUBMIT, spec))
        except OSError as error:
            self._streams.pop(spec.request_id, None)
            raise ShuttingDownError(f"the engine process is gone: {error}") from error
        return stream

    def cancel(self, request_id: str) -> None:
        try:
            self._sender.send((CANCEL, request_id))
        except OSError:  # the engine process is gone: its streams were ended
            pass

    def stop(self, grace_s: float = 0) -> None:
        """Refuse new requests, let the engine drain for `grace_s`, stop the process."""
        self._is_accepting = False
        self._is_stopping = True
        if self._process.is_alive():
            try:
                self._sender.send((STOP, grace_s))
            except OSError:
                pass
            self._stopped.wait(grace_s + 30)
        self._process.join(10)
        if self._process.is_alive():
            log.warning("engine process %d did not exit; killing it", self._process.pid)
            self._process.kill()
            self._process.join(5)
        self._receiver.join(timeout=5)

    # ---- the pipe -----------------------------------------------------------------------------
    def _call(self, method: str, timeout_s: float):
        call_id = next(self._call_ids)
        future: Future = Future()
        self._calls[call_id] = future
        try:
            self._sender.send((CALL, call_id, method))
        except OSError as error:
            self._calls.pop(call_id, None)
            raise EngineProcessError(f"the engine process is gone: {error}") from error
        return future.result(timeout_s)

    def _receive(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == ITEMS:
                self._deliver(message[1])
            elif message[0] == STOPPED:
                self._stopped.set()
                break
        self._ended()

    def _deliver(self, items: list) -> None:
        streams, woken = self._streams, []
        for item in items:
            tag = item[0]
            if tag == TOKENS:
                stream = streams.get(item[1])
                if stream is not None:
                    stream.push(OutputEvent.of_tokens(item[2], item[3], ()))
                    woken.append(stream)
            elif tag == EVENT:
                event = item[2]
                stream = streams.pop(item[1], None) if event.is_final else streams.get(item[1])
                if stream is not None:
                    stream.push(event)
                    woken.append(stream)
            elif tag == FINISHED:
                for listener in self.table.finish_listeners:
                    try:
                        listener(item[2])
                    except Exception:  # noqa: BLE001 -- observers must never stop the events
                        log.exception("finish listener %r failed for request %s", listener, item[1])
            elif tag == REPLY:
                future = self._calls.pop(item[1], None)
                if future is not None:
                    future.set_result(item[2]) if item[3] is None else future.set_exception(item[3])
        for stream in woken:
            stream.wake()

    def _ended(self) -> None:
        """The pipe closed: end every open stream and call; unasked, say why (`on_exit`)."""
        self._is_accepting = False
        if not self._is_stopping:
            self._process.join(5)
            self.failure = f"the engine process exited unexpectedly (exit code {self._process.exitcode})"
            log.error("%s", self.failure)
        error = ShuttingDownError(self.failure or "the engine stopped before the request finished")
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(OutputEvent(finish_reason=FinishReason.ERROR, error=error))
        for call_id in list(self._calls):
            future = self._calls.pop(call_id, None)
            if future is not None:
                future.set_exception(EngineProcessError(self.failure or "the engine process stopped"))
        if self.failure is not None and self.on_exit is not None:
            self.on_exit(self.failure)
