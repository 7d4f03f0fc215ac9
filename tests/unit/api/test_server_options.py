"""The public server's HTTP/2 settings reach gRPC core: max_connection_age sends GOAWAY (the
client's connection goes back to IDLE and reconnects), keepalive and ping policy are set."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from generation_service.config import ServeConfig
from generation_service.server import server_options


def test_defaults_keep_connections_and_let_clients_ping():
    options = dict(server_options(ServeConfig()))
    assert "grpc.max_connection_age_ms" not in options  # off unless asked (the chart asks)
    assert options["grpc.keepalive_time_ms"] == 60_000 and options["grpc.keepalive_timeout_ms"] == 20_000
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 10_000
    aged = dict(server_options(ServeConfig(max_connection_age_s=300, max_connection_age_grace_s=30)))
    assert (aged["grpc.max_connection_age_ms"], aged["grpc.max_connection_age_grace_ms"]) == (300_000, 30_000)
    assert "grpc.max_connection_age_grace_ms" not in dict(server_options(ServeConfig(max_connection_age_s=300)))


def test_max_connection_age_makes_clients_reconnect():
    server = grpc.server(futures.ThreadPoolExecutor(2), options=server_options(ServeConfig(max_connection_age_s=0.5)))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    states: list[grpc.ChannelConnectivity] = []
    went_idle = threading.Event()

    def watch(state):
        states.append(state)
        if grpc.ChannelConnectivity.READY in states and state is not grpc.ChannelConnectivity.READY:
            went_idle.set()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            channel.subscribe(watch, try_to_connect=True)
            stub = health_pb2_grpc.HealthStub(channel)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
            assert went_idle.wait(15), f"no GOAWAY after max_connection_age: states {states}"
            # the next call reconnects transparently
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
            channel.unsubscribe(watch)
    finally:
        server.stop(0)
