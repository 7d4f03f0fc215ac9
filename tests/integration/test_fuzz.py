"""The fuzz suite (issue 19): at least 500 generated adversarial requests against a real
`structgen serve` of its own (default model, default limits).

Every call must end with a status other than INTERNAL and UNKNOWN within 30 s; neither
process may crash (no grammar child restart, serve alive); afterwards GetEngineStats is idle
and a normal constrained request works. The requests: tests/integration/fuzz_requests.py.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from fuzz_requests import families, requests
from live_server import start_serve, stop_serve
from structgen.v1 import generation_pb2 as pb
from structgen.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

CALL_LIMIT_S = 30.0
NUM_GENERATED = 300  # hypothesis examples, beside the hand-written families
GENERATE = "/structgen.v1.GenerationService/Generate"
BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    server = start_serve(["--max-new-tokens-limit=64", "--default-max-tokens=4"], folder / "serve.log")
    channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20),
                                                             ("grpc.max_receive_message_length", 64 << 20)])
    server.raw_generate = channel.unary_stream(GENERATE, request_serializer=None,
                                               response_deserializer=pb.GenerateResponse.FromString)
    server.stub = pb_grpc.GenerationServiceStub(channel)
    server.outcomes = {}
    yield server
    channel.close()
    if server.process.poll() is None:
        assert stop_serve(server) == 0


def _call(server, name: str, data: bytes) -> str:
    """'' when the call ended acceptably, else why not."""
    started = time.monotonic()
    try:
        for _ in server.raw_generate(data, timeout=CALL_LIMIT_S):
            pass
        code = grpc.StatusCode.OK
        details = ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    took_s = time.monotonic() - started
    server.outcomes[code.name] = server.outcomes.get(code.name, 0) + 1
    if code in BAD_CODES:
        return f"{name}: {code.name} {details[:300]}"
    if code is grpc.StatusCode.DEADLINE_EXCEEDED or took_s > CALL_LIMIT_S:
        return f"{name}: took {took_s:.1f} s ({code.name})"
    if server.process.poll() is not None:
        return f"{name}: structgen serve exited with {server.process.returncode}"
    return ""


def test_hand_written_adversarial_families(fuzz_server):
    cases = families()
    assert len(cases) >= 250
    with ThreadPoolExecutor(8) as pool:  # heavy compiles overlap; each call is still bounded
        problems = [p for p in pool.map(lambda case: _call(fuzz_server, *case), cases) if p]
    assert not problems, "\n".join(problems[:20])
    fuzz_server.num_calls = len(cases)


@settings(max_examples=NUM_GENERATED, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(data=requests())
def test_generated_requests(fuzz_server, data):
    problem = _call(fuzz_server, f"generated {data[:120]!r}", data)
    assert not problem


def test_after_the_fuzz_the_server_is_idle_healthy_and_serves(fuzz_server):
    total = sum(fuzz_server.outcomes.values())
    assert total >= 500, fuzz_server.outcomes
    deadline = time.monotonic() + 30
    stats = fuzz_server.stub.GetEngineStats(pb.GetEngineStatsRequest(), timeout=10)
    while (stats.num_waiting or stats.num_running or stats.num_kv_pages_used or stats.num_slots_used
           or stats.num_grammar_matchers) and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = fuzz_server.stub.GetEngineStats(pb.GetEngineStatsRequest(), timeout=10)
    assert not (stats.num_waiting or stats.num_running or stats.num_kv_pages_used or stats.num_slots_used
                or stats.num_grammar_matchers), stats
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    request = pb.GenerateRequest(prompt="A person:", json_schema=json.dumps(schema),
                                 stop=pb.StopConditions(max_tokens=64))
    final = list(fuzz_server.stub.Generate(request, timeout=120))[-1]
    assert final.validation.status in (pb.VALIDATION_STATUS_VALID, pb.VALIDATION_STATUS_INVALID)
    log = fuzz_server.log_text()
    assert "grammar_service exited with" not in log, "a grammar child crashed during the fuzz"
    assert "internal error" not in log
    print(f"fuzz outcomes: {fuzz_server.outcomes}")
