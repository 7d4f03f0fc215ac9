"""The public gRPC server: converts proto <-> domain and calls one engine method per rpc.

No torch here: the engine is handed in. The server is grpc.aio on an event loop of its own
thread (`AioLoop`): every stream is a task on that one thread, awaiting its engine
`RequestStream` (`abatches`), so a streamed token costs no thread switch, and the engine
loop shares the GIL with two threads (this loop, gRPC's poller) whatever the number of
streams. Work that may take milliseconds (tokenizing a prompt, rendering a chat) runs on a
pool of `ServeConfig.num_workers` threads, off the loop. Errors are raised as domain
exceptions and mapped to statuses by `interceptors.ErrorMappingInterceptor`. Health
(grpc.health.v1, overall and per service) and server reflection (v1 and v1alpha) are
registered beside GenerationService.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from generation_service import metrics, proto_convert, proto_turn, tracing
from generation_service.config import ServeConfig
from generation_service.engine.errors import (DeadlineExceededError, EngineError, LimitExceededError,
                                              ShuttingDownError)
from generation_service.engine.events import FinishReason
from generation_service.interceptors import (BearerTokenInterceptor, DecodeInHandlerInterceptor,
                                             ErrorMappingInterceptor, OpenRpcLimitInterceptor)
from grammar_contract.spec import GRAMMAR_KINDS
import structgen
from structgen import telemetry
from structgen.reflection import enable_reflection
from structgen.schema_validation import validate_output
from structgen.v1 import generation_pb2 as pb
from structgen.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("structgen.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
_NO_DEADLINE_S = 1e7  # grpc reports a far-future deadline when the client set none
# grpc.aio servers on the API port, one event loop: each accepts one call at a time, each accept a
# few turns of the loop; one server kept new calls 86-165 ms from their handler under the 1B's
# c=128 stream load on an H200; 4 left ~100 ms where connections were uneven, 16 ~18 ms
# (docs/serving.md, "Accepting calls").
LISTENERS = 16


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, engine, config: ServeConfig, blocking: futures.Executor):
        self._engine = engine
        self._config = config
        self._blocking = blocking  # for work that would hold the loop (tokenizing, chat templates)
        self.is_draining = False
        self.num_open_streams = 0  # changed on the loop's thread only

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        if self.is_draining:  # health says NOT_SERVING; a client that still calls is told so
            raise ShuttingDownError("the server is draining (shutting down); send the request to another replica")
        self.num_open_streams += 1
        try:
            await self._generate(request, context)
        finally:
            self.num_open_streams -= 1

    async def _off_loop(self, function, *args):
        """`function(*args)` on the blocking pool; token ids need no such trip."""
        return await asyncio.get_running_loop().run_in_executor(self._blocking, functools.partial(function, *args))

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        if not request.request_id:  # assigned here so error logs and the client see the same id
            request.request_id = uuid.uuid4().hex[:16]
        limit = self._engine.config.max_new_tokens_limit
        if request.stop.max_tokens > limit:  # named as the client wrote it
            raise LimitExceededError(f"stop.max_tokens {request.stop.max_tokens} exceeds the server's "
                                     f"max_new_tokens_limit {limit}")
        max_drafts = self._engine.config.max_draft_tokens
        if request.speculative.num_draft_tokens > max_drafts:
            raise LimitExceededError(f"speculative.num_draft_tokens {request.speculative.num_draft_tokens} exceeds "
                                     f"the server's max_draft_tokens {max_drafts}")
        remaining = context.time_remaining()
        args = (request, self._engine.tokenizer, self._config,
                None if remaining is None or remaining > _NO_DEADLINE_S else remaining)
        if request.WhichOneof("input") == "token_ids":
            domain, turn = proto_convert.convert_generate(*args)
        else:
            domain, turn = await self._off_loop(proto_convert.convert_generate, *args)
        operation = "chat" if request.WhichOneof("input") == "chat" else "text_completion"
        # the rpc span becomes "{operation} {model}"; compile and engine spans join its trace
        domain = tracing.start_request(domain, operation, self._engine.model_name)
        try:
            await self._stream(domain, turn, context)
        finally:
            tracing.end_request(domain.request_id)

    async def _stream(self, domain, turn, context: grpc.aio.ServicerContext) -> None:
        """Write the request's events until its final one; failures raised as their statuses.
        A turn (reasoning, tools): the parser splits each message's text into reasoning,
        content and calls, and the final validation covers the content alone."""
        schema = domain.grammar.text if domain.grammar is not None and domain.grammar.kind == "json_schema" else None
        parser = turn.parser(self._engine.tokenizer, domain.prompt_ids) if turn is not None else None
        texts: list[str] = []
        stream = self._engine.submit(domain)
        observer = metrics.get().observer(domain)
        try:
            # Events queued while this task waited go out as one message (stream.coalesce).
            async for event in stream.acoalesced():
                observer.event(event)
                if event.error is not None:
                    raise event.error
                if event.finish_reason is FinishReason.DEADLINE:
                    raise DeadlineExceededError(f"request {domain.request_id}: deadline exceeded")
                if event.finish_reason is FinishReason.CANCELLED:
                    return  # the client is gone; nobody reads a status
                if event.finish_reason is FinishReason.ERROR:
                    raise EngineError(f"request {domain.request_id} failed")
                piece = parser.feed(event.text, event.is_final, event.token_ids) if parser is not None else None
                validation = None
                if schema is not None:
                    texts.append(event.text if piece is None else piece.content)
                    if event.is_final:  # the whole output against the full schema (docs/guarantees.md)
                        validation = validate_output(schema, "".join(texts),
                                                     event.finish_reason is FinishReason.MAX_TOKENS)
                        observer.validated("json_schema", validation)
                response = proto_convert.event_to_proto(event, domain, validation)
                if piece is not None:
                    for call_validation in proto_turn.add_piece(response, piece, turn,
                                                                proto_convert.validation_to_proto):
                        observer.validated("tool_call", call_validation)
                await context.write(response)
        finally:
            # Client disconnect (the task is cancelled), deadline or a failed write: free what the
            # request holds. A finished request has nothing left to free.
            if not stream.is_finished:
                stream.cancel()

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext):
        ids = await self._off_loop(proto_convert.prompt_ids, request, self._engine.tokenizer)
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext):
        engine, config = self._engine, self._config
        engine_config = engine.config
        return pb.GetModelInfoResponse(
            model_name=engine.model_name, vocab_size=engine.tokenizer.vocab_size,
            eos_token_ids=list(engine.tokenizer.eos_token_ids), device=str(engine_config.device),
            max_prompt_tokens=engine_config.max_prompt_tokens,
            max_new_tokens_limit=engine_config.max_new_tokens_limit,
            default_max_tokens=config.default_max_tokens,
            max_grammar_bytes=config.max_grammar_bytes, max_message_bytes=config.max_message_bytes,
            max_batch=engine_config.max_batch, max_draft_tokens=engine_config.max_draft_tokens,
            constraint_kinds=list(GRAMMAR_KINDS), prefill_chunk_tokens=engine_config.prefill_chunk_tokens,
            max_prefill_tokens=engine_config.max_prefill_tokens, prefix_caching=engine_config.prefix_caching,
            **proto_turn.model_info(engine.tokenizer))

    async def GetEngineStats(self, request: pb.GetEngineStatsRequest, context: grpc.aio.ServicerContext):
        stats = self._engine.stats()
        return pb.GetEngineStatsResponse(
            num_waiting=stats.num_waiting, num_running=stats.num_running,
            num_kv_pages_used=stats.num_kv_pages_used, num_slots_used=stats.num_slots_used,
            num_grammar_matchers=stats.num_grammar_matchers, grammar_available=stats.grammar_available,
            num_kv_pages_total=stats.num_kv_pages_total, num_finished=stats.num_finished,
            num_tokens_generated=stats.tokens_generated,
            num_draft_tokens_proposed=stats.draft_proposed,
            num_draft_tokens_accepted=stats.draft_accepted, num_steps=stats.steps,
            num_mixed_steps=stats.num_mixed_steps, num_prefill_tokens=stats.num_prefill_tokens,
            graph_step_seconds=stats.graph_step_s_total, mixed_step_seconds=stats.mixed_step_s_total,
            num_kv_pages_cached=stats.num_kv_pages_cached,
            num_prefix_cache_query_tokens=stats.prefix_cache_query_tokens,
            num_prefix_cache_hit_tokens=stats.prefix_cache_hit_tokens,
            num_prefix_cache_evictions=stats.prefix_cache_evictions,
            num_late_rows=stats.num_late_rows, num_held_graph_host_steps=stats.num_held_graph_host_steps,
            num_chained_steps=stats.num_chained_steps, num_chained_grammar_steps=stats.num_chained_grammar_steps)


class AioLoop:
    """An asyncio loop running on a thread of its own, for the servers; `call` runs a
    coroutine there from any other thread and returns its result."""

    def __init__(self, name: str = "grpc-aio") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coroutine, timeout_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass
class RunningServer:
    aio: AioLoop
    servers: list[grpc.aio.Server]  # the listeners of the API port
    health: health.aio.HealthServicer
    port: int
    servicer: GenerationServicer
    blocking: futures.ThreadPoolExecutor
    health_server: grpc.aio.Server | None = None

    def set_serving(self, is_serving: bool) -> None:
        self.aio.call(_set_health(self.health, health_pb2.HealthCheckResponse.SERVING if is_serving
                                  else health_pb2.HealthCheckResponse.NOT_SERVING))

    def stop(self, grace_s: float) -> None:
        """Drain, then close. For the whole drain the port stays open and health answers
        NOT_SERVING (overall and per service), so a load balancer polling it moves traffic
        away; new Generate calls get UNAVAILABLE while open streams finish. Once none is open,
        or grace_s has passed, the server stops (cancelling what is left)."""
        deadline = time.monotonic() + grace_s
        self.set_serving(False)
        self.servicer.is_draining = True
        while self.servicer.num_open_streams and time.monotonic() < deadline:
            time.sleep(0.02)
        self.aio.call(_stop_all(self.servers, max(0.0, deadline - time.monotonic())))
        if self.health_server is not None:
            self.aio.call(self.health_server.stop(0))
        self.aio.close()
        self.blocking.shutdown(wait=False, cancel_futures=True)


async def _stop_all(servers: list[grpc.aio.Server], grace_s: float) -> None:
    await asyncio.gather(*(server.stop(grace_s) for server in servers))


def _credentials(config: ServeConfig) -> grpc.ServerCredentials:
    def read(path):
        with open(path, "rb") as file:
            return file.read()
    ca = read(config.tls_client_ca) if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(read(config.tls_key), read(config.tls_cert))],
                                       root_certificates=ca, require_client_auth=ca is not None)


def _interceptors(config: ServeConfig, open_rpcs: OpenRpcLimitInterceptor) -> list[grpc.aio.ServerInterceptor]:
    # Outermost first: the server span and the status count see undecodable requests, auth and
    # open-RPC refusals too.
    interceptors: list[grpc.aio.ServerInterceptor] = [metrics.get().interceptor(), open_rpcs]
    if telemetry.is_enabled():
        interceptors.insert(0, tracing.TracingInterceptor())
    interceptors.append(DecodeInHandlerInterceptor())
    if config.auth_token_file:
        with open(config.auth_token_file, encoding="utf-8") as file:
            interceptors.append(BearerTokenInterceptor(file.read().strip()))
    return interceptors + [ErrorMappingInterceptor()]


def _start_health_server(config: ServeConfig, health_servicer) -> grpc.aio.Server:
    """Plaintext, health only: kubelet gRPC probes speak neither TLS nor bearer tokens."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{config.bind_address.rsplit(':', 1)[0]}:{config.health_port}")
    return server


def server_options(config: ServeConfig) -> list[tuple[str, int]]:
    """gRPC core channel arguments of the public server: message limit and HTTP/2 keepalive."""
    ms = lambda seconds: int(seconds * 1000)  # noqa: E731
    options = [("grpc.max_receive_message_length", config.max_message_bytes),
               # the listeners share the port; `structgen serve` checks that nothing else holds it
               # (serve_preflight), and a later process cannot bind it without SO_REUSEPORT itself
               ("grpc.so_reuseport", int(LISTENERS > 1)),
               # clients may ping between calls too, as often as this (else GOAWAY too_many_pings)
               ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.min_ping_interval_without_data_ms", ms(config.min_client_ping_interval_s)),
               ("grpc.http2.max_pings_without_data", 0)]
    if config.keepalive_time_s > 0:  # 0: gRPC's own default (2 h)
        options += [("grpc.keepalive_time_ms", ms(config.keepalive_time_s)),
                    ("grpc.keepalive_timeout_ms", ms(config.keepalive_timeout_s))]
    if config.max_connection_age_s > 0:
        options.append(("grpc.max_connection_age_ms", ms(config.max_connection_age_s)))
        if config.max_connection_age_grace_s > 0:  # unset: gRPC lets open streams run to the end
            options.append(("grpc.max_connection_age_grace_ms", ms(config.max_connection_age_grace_s)))
    return options


def start_server(engine, config: ServeConfig) -> RunningServer:
    """Bind, register services, start; SERVING once this returns. Port 0 picks a free one."""
    aio = AioLoop()
    try:
        return aio.call(_start(aio, engine, config))
    except BaseException:
        aio.close()
        raise


async def _start(aio: AioLoop, engine, config: ServeConfig) -> RunningServer:
    blocking = futures.ThreadPoolExecutor(max_workers=config.num_workers, thread_name_prefix="rpc")
    servicer = GenerationServicer(engine, config, blocking)
    metrics.get().watch(engine, structgen.__version__)  # engine gauges at scrape time
    engine.table.finish_listeners.append(tracing.RequestSpans())
    health_servicer = health.aio.HealthServicer()
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)  # not before we are
    open_rpcs = OpenRpcLimitInterceptor(config.max_concurrent_rpcs)  # one count over every listener
    servers, port = [], 0
    for address in [config.bind_address] + [None] * (LISTENERS - 1):
        server = grpc.aio.server(interceptors=_interceptors(config, open_rpcs), options=server_options(config))
        pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        enable_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server)
        address = address or f"{config.bind_address.rsplit(':', 1)[0]}:{port}"  # the first one's port
        bound = (server.add_secure_port(address, _credentials(config)) if config.uses_tls
                 else server.add_insecure_port(address))
        if bound == 0 or port not in (0, bound):
            raise OSError(f"cannot listen on {address}")
        port = bound
        servers.append(server)
    for server in servers:
        await server.start()
    health_server = _start_health_server(config, health_servicer) if config.health_port else None
    if health_server is not None:
        await health_server.start()
    running = RunningServer(aio, servers, health_servicer, port, servicer, blocking, health_server)
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    return running


async def _set_health(health_servicer, status) -> None:
    """The status overall ("") and of GenerationService (on the servicer's loop)."""
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, status)
