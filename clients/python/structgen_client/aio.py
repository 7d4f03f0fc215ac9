"""asyncio client: `async for chunk in AsyncClient(address).generate(...)`."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence

import grpc
import grpc.aio
from structgen.v1 import generation_pb2 as pb
from structgen.v1 import generation_pb2_grpc as pb_grpc

from structgen_client._convert import (build_request, build_tokenize_request, to_chunk,
                                       to_engine_stats, to_model_info)
from structgen_client.client import auth_metadata, call_metadata, make_channel
from structgen_client.errors import from_rpc_error
from structgen_client.types import Chunk, Completion, EngineStats, ModelInfo


class AsyncGenerationStream:
    """Async iterator over the chunks of one Generate call; `cancel()` stops it on the server."""

    def __init__(self, call):
        self._call = call
        self._is_cancelled = False

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        try:
            async for response in self._call:
                yield to_chunk(response)
        except asyncio.CancelledError:
            if not self._is_cancelled:
                raise
        except grpc.RpcError as error:
            if self._is_cancelled and error.code() == grpc.StatusCode.CANCELLED:
                return  # we cancelled it ourselves: the stream just ends
            raise from_rpc_error(error) from None

    def cancel(self) -> None:
        self._is_cancelled = True
        self._call.cancel()


class AsyncClient:
    """asyncio twin of `Client`; create it inside a running event loop."""

    def __init__(self, address: str = "localhost:50051", *, timeout: float | None = None,
                 token: str | None = None, root_certificates: bytes | None = None, options=(),
                 propagate_trace: bool = True):
        self._channel = make_channel(address, root_certificates, list(options), aio=True)
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._timeout = timeout
        self._metadata = auth_metadata(token)
        self._propagate_trace = propagate_trace

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = (), **options: Any) -> AsyncGenerationStream:
        request = build_request(prompt, **options)
        return AsyncGenerationStream(self._stub.Generate(
            request, timeout=timeout or self._timeout,
            metadata=call_metadata(self._metadata, self._propagate_trace, metadata)))

    async def generate_text(self, prompt: str | None = None, *, timeout: float | None = None,
                            **options: Any) -> Completion:
        return Completion.from_chunks([c async for c in self.generate(prompt, timeout=timeout, **options)])

    async def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None,
                 tools: Sequence[dict] | None = None, reasoning: bool | None = None) -> list[int]:
        response = await self._unary(self._stub.Tokenize, build_tokenize_request(text, messages, tools, reasoning))
        return list(response.token_ids)

    async def model_info(self) -> ModelInfo:
        return to_model_info(await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest()))

    async def engine_stats(self) -> EngineStats:
        return to_engine_stats(await self._unary(self._stub.GetEngineStats, pb.GetEngineStatsRequest()))

    async def _unary(self, method, request):
        try:
            return await method(request, timeout=self._timeout,
                                metadata=call_metadata(self._metadata, self._propagate_trace, ()))
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
