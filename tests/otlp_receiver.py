"""An in-test OTLP/gRPC trace receiver (what Jaeger's collector does on :4317), built from the
opentelemetry-proto collector stubs. Processes under test export to `receiver.endpoint`;
tests read back flat `ReceivedSpan`s with their service name and ids as hex.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str          # resource attribute service.name of the exporting process
    name: str
    trace_id: str         # 32 hex digits
    span_id: str          # 16 hex digits
    parent_span_id: str   # "" for a root span
    kind: int             # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict
    status_code: int      # 0 unset, 1 ok, 2 error
    resource: dict        # all resource attributes of the exporting process


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: "OtlpReceiver"):
        self._receiver = receiver

    def Export(self, request, context):
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        service=resource.get("service.name", ""), name=span.name,
                        trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), kind=span.kind,
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        status_code=span.status.code, resource=resource))
        self._receiver._add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """Start with `with OtlpReceiver() as receiver:`; export to `receiver.endpoint`."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "OtlpReceiver":
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(0)

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self._spans.extend(spans)
            self._changed.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._changed:
            return list(self._spans)

    def wait_for(self, predicate, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans once `predicate(spans)` is true; the spans so far after the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate(self._spans):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            return list(self._spans)
