"""Synchronous client: `Client(address).generate(...)` yields `Chunk`s as tokens arrive."""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structgen.v1 import generation_pb2 as pb
from structgen.v1 import generation_pb2_grpc as pb_grpc

from structgen_client._convert import (build_request, build_tokenize_request, to_chunk,
                                       to_engine_stats, to_model_info)
from structgen_client.errors import from_rpc_error
from structgen_client.types import Chunk, Completion, EngineStats, ModelInfo


class GenerationStream:
    """Iterator over the chunks of one Generate call; `cancel()` stops it on the server too."""

    def __init__(self, call):
        self._call = call
        self._is_cancelled = False

    def __iter__(self) -> Iterator[Chunk]:
        try:
            for response in self._call:
                yield to_chunk(response)
        except grpc.RpcError as error:
            if self._is_cancelled and error.code() == grpc.StatusCode.CANCELLED:
                return  # we cancelled it ourselves: the stream just ends
            raise from_rpc_error(error) from None

    def cancel(self) -> None:
        self._is_cancelled = True
        self._call.cancel()

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


def make_channel(address: str, root_certificates: bytes | None, options, aio: bool = False):
    """Plaintext, or TLS when `root_certificates` (PEM bytes of the server's CA) is given."""
    module = grpc.aio if aio else grpc
    if root_certificates is None:
        return module.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    return module.secure_channel(address, credentials, options=options)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """W3C `traceparent` / `tracestate` of the caller's current OpenTelemetry span (nothing
    outside a span, or without opentelemetry-api), so the server's spans join its trace."""
    try:
        from opentelemetry import propagate
    except ImportError:
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple((k, v) for k, v in carrier.items() if k in ("traceparent", "tracestate"))


def call_metadata(base, propagate_trace: bool, extra) -> tuple[tuple[str, str], ...]:
    """Metadata of one call: the client's (token), the trace context, then the caller's own."""
    return (*base, *(trace_metadata() if propagate_trace else ()), *(extra or ()))


class Client:
    """A connection to a structgen server.

    `timeout` (seconds) is the default call deadline; `token` is sent as
    "authorization: Bearer <token>" (servers started with --auth-token-file);
    `root_certificates` (PEM bytes) switches to TLS. With `propagate_trace` (default) each
    call sends the current OpenTelemetry span's `traceparent`, so the server's spans are
    children of the caller's; `metadata=` on a call adds gRPC metadata of its own.
    """

    def __init__(self, address: str = "localhost:50051", *, timeout: float | None = None,
                 token: str | None = None, root_certificates: bytes | None = None,
                 channel: grpc.Channel | None = None, options=(), propagate_trace: bool = True):
        self._channel = channel or make_channel(address, root_certificates, list(options))
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._timeout = timeout
        self._metadata = auth_metadata(token)
        self._propagate_trace = propagate_trace

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = (), **options: Any) -> GenerationStream:
        """Stream a completion. Options: see `structgen_client.build_request`."""
        request = build_request(prompt, **options)
        return GenerationStream(self._stub.Generate(
            request, timeout=timeout or self._timeout,
            metadata=call_metadata(self._metadata, self._propagate_trace, metadata)))

    def generate_text(self, prompt: str | None = None, *, timeout: float | None = None,
                      metadata: Sequence[tuple[str, str]] = (), **options: Any) -> Completion:
        """The whole completion at once (unary-style use of the stream)."""
        return Completion.from_chunks(self.generate(prompt, timeout=timeout, metadata=metadata, **options))

    def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None,
                 tools: Sequence[dict] | None = None, reasoning: bool | None = None) -> list[int]:
        return list(self._unary(self._stub.Tokenize, build_tokenize_request(text, messages, tools, reasoning)).token_ids)

    def model_info(self) -> ModelInfo:
        return to_model_info(self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest()))

    def engine_stats(self) -> EngineStats:
        return to_engine_stats(self._unary(self._stub.GetEngineStats, pb.GetEngineStatsRequest()))

    def health(self, service: str = "") -> str:
        """"SERVING", "NOT_SERVING", ... of the server ("") or one service."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        response = self._unary(stub.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the channel connects (raises UnavailableError after `timeout`)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            from structgen_client.errors import UnavailableError
            raise UnavailableError(f"no server reachable within {timeout} s") from None

    def _unary(self, method, request):
        try:
            return method(request, timeout=self._timeout,
                          metadata=call_metadata(self._metadata, self._propagate_trace, ()))
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
