"""The API port's listeners (server.LISTENERS grpc.aio servers sharing it): every connection gets
every service, and --max-concurrent-rpcs counts over all of them."""
from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from generation_service.server import LISTENERS
from live_server import start_serve, stop_serve
from structgen.v1 import generation_pb2 as pb
from structgen.v1 import generation_pb2_grpc as pb_grpc

NUM_CONNECTIONS = 8 * LISTENERS  # the kernel spreads connections over the listeners: each one reached but
                                 # with p < 0.01


def _connection(address: str) -> grpc.Channel:
    """A channel with a connection of its own (no subchannel shared with other channels)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def _request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Count:", stop=pb.StopConditions(max_tokens=max_tokens, ignore_eos=True))


def test_every_connection_gets_every_service(live_server):
    channels = [_connection(live_server.address) for _ in range(NUM_CONNECTIONS)]
    try:
        for channel in channels:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            messages = list(pb_grpc.GenerationServiceStub(channel).Generate(_request(2), timeout=60))
            assert sum(len(m.token_ids) for m in messages) == 2
            assert messages[-1].finish_reason == pb.FINISH_REASON_MAX_TOKENS
    finally:
        for channel in channels:
            channel.close()


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory):
    server = start_serve(["--max-concurrent-rpcs=3", "--max-new-tokens-limit=4096"],
                         tmp_path_factory.mktemp("limited") / "serve.log")
    yield server
    assert stop_serve(server) == 0, server.log_text()[-4000:]


def _generates_once_freed(channel: grpc.Channel, timeout_s: float = 30.0) -> bool:
    """A short Generate succeeds once the server has seen a cancel (it ends the handler soon after)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            messages = list(pb_grpc.GenerationServiceStub(channel).Generate(_request(2), timeout=60))
            return messages[-1].finish_reason == pb.FINISH_REASON_MAX_TOKENS
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_open_rpc_limit_counts_over_all_listeners(limited_server):
    channels = [_connection(limited_server.address) for _ in range(NUM_CONNECTIONS)]
    open_streams = []
    try:
        for channel in channels[:3]:  # three long streams, each on its own connection
            stream = pb_grpc.GenerationServiceStub(channel).Generate(_request(4000), timeout=600)
            next(stream)
            open_streams.append(stream)
        for channel in channels[3:]:  # whichever listener a connection reached, the fourth RPC is refused
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-concurrent-rpcs" in refused.value.details()
        open_streams.pop().cancel()
        assert _generates_once_freed(channels[3])
    finally:
        for stream in open_streams:
            stream.cancel()
        for channel in channels:
            channel.close()
