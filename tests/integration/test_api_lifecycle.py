"""Cancellation, deadlines, health and reflection against a real server."""
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from structgen_client import Client, DeadlineExceededError

SERVICE = "structgen.v1.GenerationService"


def test_cancel_mid_stream_frees_everything(client, wait_idle):
    # 40 items cannot fit in 64 tokens: the grammar never completes before the cancel.
    stream = client.generate("Tell a long story:", max_tokens=64, ignore_eos=True,
                             json_schema={"type": "array", "items": {"type": "string"}, "minItems": 40})
    received = []
    for chunk in stream:
        received.append(chunk)
        if sum(len(c.token_ids) for c in received) >= 3:
            busy = client.engine_stats()
            assert busy.num_running + busy.num_waiting >= 1 and busy.num_kv_pages_used >= 1
            assert busy.num_grammar_matchers >= 1
            stream.cancel()
    assert sum(len(c.token_ids) for c in received) < 64 and received[-1].finish_reason is None
    wait_idle()


def test_client_disconnect_frees_everything(live_server, wait_idle):
    other = Client(live_server.address)
    stream = iter(other.generate("Keep going:", max_tokens=64, ignore_eos=True))
    next(stream)
    other.close()  # the connection goes away without a cancel
    wait_idle()


def test_deadline_ends_the_stream_and_frees_everything(client, wait_idle):
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        for _ in client.generate("Slowly:", max_tokens=64, ignore_eos=True, timeout=0.3):
            pass
    assert time.monotonic() - started < 5
    wait_idle()


def test_health_is_serving_overall_and_per_service(live_server):
    with grpc.insecure_channel(live_server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as caught:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_and_describes_the_api(live_server, version):
    """Both reflection services answer (grpcurl and current clients ask v1 first)."""
    with grpc.insecure_channel(live_server.address) as channel:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="grpc.reflection.v1.ServerReflection")]
        replies = list(call(iter(requests), timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
            "grpc.reflection.v1.ServerReflection"} <= names
    assert replies[1].file_descriptor_response.file_descriptor_proto
    v1_file = descriptor_pb2.FileDescriptorProto.FromString(
        replies[2].file_descriptor_response.file_descriptor_proto[0])
    assert v1_file.package == "grpc.reflection.v1"
    assert v1_file.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"


def test_engine_stats_count_finished_requests(client):
    before = client.engine_stats()
    client.generate_text("Count me", max_tokens=3)
    after = client.engine_stats()
    assert after.num_finished == before.num_finished + 1
    assert after.num_tokens_generated >= before.num_tokens_generated + 3
    assert after.grammar_available
