"""The gRPC edge in-process: proto <-> GrammarSpec, CLI defaults, health port, status mapping."""
from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from generation_service.engine.errors import GrammarUnavailableError
from generation_service.engine.params import GrammarSpec
from grammar_service.client import GrammarControlClient, spec_to_proto
from grammar_service.config import GrammarServiceConfig
from grammar_service.server import RunningServer, build_parser, main, spec_from_proto


@pytest.mark.parametrize("spec", [
    GrammarSpec("json_schema", '{"type": "integer"}'),
    GrammarSpec("json_schema", "{}", any_whitespace=False, max_whitespace=0, strict=True, backend="llguidance"),
    GrammarSpec("regex", "a+", max_whitespace=3), GrammarSpec("lark", "start: /x/"),
    GrammarSpec("structural_tag", "{}"), GrammarSpec("json_object"), GrammarSpec("choice", choices=("a", "b")),
])
def test_grammar_spec_survives_the_proto(spec):
    assert spec_from_proto(spec_to_proto(spec)) == spec


def test_cli_defaults_are_the_config_defaults():
    args = vars(build_parser().parse_args([]))
    args.pop("log_level")
    assert GrammarServiceConfig(**args) == GrammarServiceConfig()
    args = vars(build_parser().parse_args(["--vocab-size", "32768", "--tokenizer-dir", "/x", "--compile-timeout-s", "2.5"]))
    assert (args["vocab_size"], args["compile_timeout_s"]) == (32768, 2.5)


def test_bad_configuration_exits_2():
    assert main(["--num-compile-threads", "0"]) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_port_and_compile_before_any_tokenizer(tmp_path):
    port = _free_port()
    config = GrammarServiceConfig(listen=f"unix://{tmp_path}/g.sock", health_port=port, shutdown_grace_s=0.5)
    running = RunningServer(config)
    client = GrammarControlClient(config.listen)
    try:
        assert client.is_serving()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(GrammarUnavailableError, match="FAILED_PRECONDITION: no tokenizer loaded yet"):
            client.compile(GrammarSpec("regex", "a")).result(10)
        assert client.stats()["num_channels"] == 0
        with grpc.insecure_channel(config.listen) as channel:  # reflection lists the service
            services = ProtoReflectionDescriptorDatabase(channel).get_services()
            assert "structgen.v1.GrammarService" in services and "grpc.health.v1.Health" in services
    finally:
        client.close()
        running.stop()
    assert not (tmp_path / "g.sock").exists()
