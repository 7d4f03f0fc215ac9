"""The control client generation_service uses to talk to grammar_service (gRPC, control only).

The engine never imports grpc: it is handed a GrammarControlClient (structgen serve and the
tests build it). Errors come back as the contract's types (grammar_contract.errors):
GrammarError (the grammar is bad or refused: INVALID_ARGUMENT), GrammarUnavailableError (the
service is down, not ready or failed: everything else), and step_channel.ChannelError from open_channel when the service refuses the region or the
tokenizer (the message says what differs).
"""
from __future__ import annotations

import concurrent.futures
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grammar_contract.errors import DeadlineExceededError, GrammarError, GrammarUnavailableError, QueueFullError
from grammar_contract.reconnect import ReconnectGuard
from grammar_contract.report import CompileResult, UnenforcedKeyword
from grammar_contract.spec import GrammarSpec
from step_channel import ChannelError, Geometry
from structgen.v1 import grammar_pb2, grammar_pb2_grpc


def spec_to_proto(spec: GrammarSpec, trace_context: dict | None = None) -> grammar_pb2.CompileRequest:
    options = grammar_pb2.GrammarOptions(any_whitespace=spec.any_whitespace, strict=spec.strict,
                                         backend=spec.backend, single_line=spec.single_line)
    if spec.max_whitespace is not None:
        options.max_whitespace = spec.max_whitespace
    req = grammar_pb2.CompileRequest(options=options, trace_context=trace_context or {})
    if spec.max_tokens is not None:
        req.max_tokens = spec.max_tokens
    if spec.reasoning is not None:
        span = spec.reasoning
        req.reasoning.CopyFrom(grammar_pb2.ReasoningSpan(begin=span.begin, end=span.end, separator=span.separator,
                                                         max_tokens=span.max_tokens, starts_open=span.starts_open))
    if spec.kind == "json_object":
        req.json_object = True
    elif spec.kind == "choice":
        req.choice.choices.extend(spec.choices)
    else:
        setattr(req, spec.kind, spec.text)
    return req


def _error_from_rpc(exc: grpc.RpcError) -> Exception:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return GrammarError(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the compiler is saturated: retry later
        return QueueFullError(f"grammar_service: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(f"grammar compile: {details or 'deadline exceeded'}")
    return GrammarUnavailableError(f"grammar_service: {code.name}: {details}")


# A compile asked while grammar_service is unreachable waits this long for it to be back (serve's
# standby takes over within a second) before it fails UNAVAILABLE.
RECONNECT_WAIT_S = 3.0
CUT_OFF_RETRIES = 3


class GrammarControlClient:
    def __init__(self, address: str, reconnect_wait_s: float = RECONNECT_WAIT_S):
        """`address`: "unix:///path.sock" or "host:port"."""
        self.address = address
        self.reconnect_wait_s = reconnect_wait_s
        # a local socket: reconnect within a fifth of a second once a restarted service listens
        # (grpc's default backoff waits 1 s and more between attempts)
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 200)])
        self._stub = grammar_pb2_grpc.GrammarServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._lock = threading.Lock()
        self._in_flight: dict[GrammarSpec, concurrent.futures.Future] = {}
        self._reconnect = ReconnectGuard(self._channel, reconnect_wait_s)

    def open_channel(self, name: str, geometry: Geometry, *, max_slots: int, first_step: int,
                     tokenizer_dir: str, tokenizer_fingerprint: str, timeout_s: float = 30) -> None:
        req = grammar_pb2.OpenChannelRequest(
            channel_name=name, max_slots=max_slots, first_step=first_step, tokenizer_dir=str(tokenizer_dir),
            tokenizer_fingerprint=tokenizer_fingerprint,
            geometry=grammar_pb2.ChannelGeometry(max_batch=geometry.max_batch, max_positions=geometry.max_positions,
                                                 vocab_size=geometry.vocab_size, depth=geometry.depth))
        try:
            self._stub.OpenChannel(req, timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                              grpc.StatusCode.ALREADY_EXISTS):
                raise ChannelError(exc.details()) from None
            raise _error_from_rpc(exc) from None

    def close_channel(self, name: str) -> None:
        try:
            self._stub.CloseChannel(grammar_pb2.CloseChannelRequest(channel_name=name), timeout=10)
        except grpc.RpcError as exc:
            raise _error_from_rpc(exc) from None

    def compile(self, spec: GrammarSpec, *, trace_context: dict | None = None,
                timeout_s: float | None = None) -> concurrent.futures.Future:
        """Future[CompileResult]; raises GrammarError, QueueFullError (compiler saturated),
        DeadlineExceededError or GrammarUnavailableError through it. `timeout_s`: a deadline
        for this call alone (None: grammar_service's compile timeout bounds it).

        Calls without a timeout for a spec whose compile is in flight share that call: a burst
        of requests on one new schema is one RPC, not one grammar_service handler thread held
        per request (grammar_service refuses waiting calls beyond its threads). While
        grammar_service is unreachable a call waits up to `reconnect_wait_s` for it to be back,
        and a call its exit cut off is made once more."""
        with self._lock:
            shared = self._in_flight.get(spec) if timeout_s is None else None
            if shared is not None:
                return shared
            result: concurrent.futures.Future = concurrent.futures.Future()
            if timeout_s is None:
                self._in_flight[spec] = result
        request = spec_to_proto(spec, trace_context)
        # Compile is idempotent: a call that grammar_service's exit cut off goes again (a few
        # times: the calls right after an exit may still meet the dead connection)
        retries = [1] * CUT_OFF_RETRIES

        def call() -> None:
            # wait_for_ready: a call made while grammar_service restarts waits for the process
            # that takes over; the guard cancels it if none has within reconnect_wait_s
            future = self._stub.Compile.future(request, timeout=timeout_s, wait_for_ready=True)
            self._reconnect.guard(future)
            future.add_done_callback(done)

        def done(call_future) -> None:
            if retries and not call_future.cancelled() and isinstance(call_future.exception(), grpc.RpcError) \
                    and call_future.exception().code() == grpc.StatusCode.UNAVAILABLE:
                retries.pop()
                call()
                return
            with self._lock:
                if self._in_flight.get(spec) is result:
                    del self._in_flight[spec]
            if call_future.cancelled():
                result.set_exception(GrammarUnavailableError(
                    f"grammar_service at {self.address} is unreachable (waited {self.reconnect_wait_s:g} s)"))
                return
            try:
                reply = call_future.result()
            except grpc.RpcError as exc:
                result.set_exception(_error_from_rpc(exc))
                return
            result.set_result(CompileResult(
                grammar_id=reply.grammar_id, backend=reply.backend, compile_ms=reply.compile_ms,
                cache_hit=reply.cached,
                unenforced=tuple(UnenforcedKeyword(u.keyword, u.pointer, u.reason) for u in reply.unenforced),
                restricted=tuple(UnenforcedKeyword(u.keyword, u.pointer, u.reason) for u in reply.restricted),
                fallback_from=reply.fallback_from))

        call()
        return result

    def is_serving(self, timeout_s: float = 2.0) -> bool:
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stats(self) -> dict:
        try:
            reply = self._stub.GetStats(grammar_pb2.GetStatsRequest(), timeout=5)
        except grpc.RpcError as exc:
            raise _error_from_rpc(exc) from None
        return {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}

    def close(self) -> None:
        self._reconnect.close()
        self._channel.close()

