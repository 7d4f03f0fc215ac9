"""Python client of structgen's public gRPC API (structgen.v1.GenerationService).

    from structgen_client import Client
    with Client("localhost:50051") as client:
        for chunk in client.generate("Name a color:", choices=["red", "green"], max_tokens=8):
            print(chunk.text, end="")

`AsyncClient` is the asyncio twin. Failed calls raise `StructgenError` subclasses carrying
the gRPC status code (`error.code`) and the server's message (`error.details`). Calls made
inside an OpenTelemetry span send its `traceparent` (`propagate_trace=False` turns it off).

Tool calls and reasoning (chat input):

    completion = client.generate_text(messages=[{"role": "user", "content": "Weather in Paris?"}],
                                      tools=[{"name": "get_weather", "parameters": {...}}],
                                      tool_choice="required", reasoning=True, reasoning_max_tokens=256)
    completion.reasoning, completion.tool_calls[0].parsed_arguments
"""
from structgen_client._convert import build_request
from structgen_client.aio import AsyncClient, AsyncGenerationStream
from structgen_client.client import Client, GenerationStream, trace_metadata
from structgen_client.errors import (CancelledError, DeadlineExceededError, InternalError,
                                     InvalidArgumentError, OutOfRangeError, ResourceExhaustedError,
                                     StructgenError, UnauthenticatedError, UnavailableError,
                                     from_rpc_error)
from structgen_client.types import (Chunk, Completion, EngineStats, Guarantee, ModelInfo,
                                    TokenLogprob, ToolCall, UnenforcedKeyword, Usage, Validation)

__all__ = [
    "AsyncClient", "AsyncGenerationStream", "CancelledError", "Chunk", "Client", "Completion",
    "DeadlineExceededError", "EngineStats", "GenerationStream", "Guarantee", "InternalError",
    "InvalidArgumentError", "ModelInfo", "OutOfRangeError", "ResourceExhaustedError",
    "StructgenError", "TokenLogprob", "ToolCall", "UnauthenticatedError", "UnavailableError",
    "UnenforcedKeyword", "Usage", "Validation", "build_request", "from_rpc_error", "trace_metadata",
]
