"""The gRPC edge in-process: proto <-> GrammarSpec, CLI defaults, health port, status mapping."""
from __future__ import annotations

import gc

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from grammar_contract.client import GrammarControlClient, spec_to_proto
from grammar_contract.errors import GrammarUnavailableError
from grammar_contract.spec import GrammarSpec, ReasoningSpan
from grammar_service.config import GrammarServiceConfig
from grammar_service.server import RunningServer, build_parser, main, spec_from_proto
from grammar_service.settings import GRAMMAR_SETTINGS
from ports import free_port
from step_channel import Geometry, StepChannel


@pytest.mark.parametrize("spec", [
    GrammarSpec("json_schema", '{"type": "integer"}'),
    GrammarSpec("json_schema", "{}", any_whitespace=False, max_whitespace=0, strict=True, backend="llguidance"),
    GrammarSpec("regex", "a+", max_whitespace=3), GrammarSpec("lark", "start: /x/"),
    GrammarSpec("structural_tag", "{}"), GrammarSpec("json_object"), GrammarSpec("choice", choices=("a", "b")),
    GrammarSpec("regex", "a+", reasoning=ReasoningSpan(separator="\n\n", max_tokens=0)),
    GrammarSpec("json_object", reasoning=ReasoningSpan("", "[/R]", starts_open=True)),
])
def test_grammar_spec_survives_the_proto(spec):
    assert spec_from_proto(spec_to_proto(spec)) == spec


def test_cli_defaults_are_the_config_defaults():
    resolved = GRAMMAR_SETTINGS.resolve(build_parser().parse_args([]), {})
    assert resolved[GrammarServiceConfig] == GrammarServiceConfig()
    args = build_parser().parse_args(["--vocab-size", "32768", "--tokenizer-dir", "/x", "--compile-timeout-s", "2.5"])
    config = GRAMMAR_SETTINGS.resolve(args, {})[GrammarServiceConfig]
    assert (config.vocab_size, config.compile_timeout_s) == (32768, 2.5)


def test_bad_configuration_exits_2(capsys):
    assert main(["--num-compile-threads", "0"], environ={}) == 2
    assert "num_compile_threads must be >= 1" in capsys.readouterr().err
    assert main(["--step-wait-spin-us", "-1"], environ={}) == 2
    assert main([], environ={"STRUCTGEN_GRAMMAR_NUM_FILL_THREADS": "many"}) == 2
    assert "STRUCTGEN_GRAMMAR_NUM_FILL_THREADS: expected an integer, got 'many'" in capsys.readouterr().err


def test_health_port_and_compile_before_any_tokenizer(tmp_path):
    port = free_port()
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


GEOMETRY = Geometry(max_batch=4, max_positions=1, vocab_size=32768)


def _is_tracked_by_full_passes(obj) -> bool:
    return any(o is obj for o in gc.get_objects())  # frozen objects are left out


def test_the_heap_is_frozen_at_start_and_after_the_first_channels_tokenizer_load(tmp_path, mistral_32k_dir,
                                                                              mistral_32k_fingerprint):
    """What exists when the server starts, and what the tokenizer load of the first OpenChannel
    builds (`structgen serve` starts grammar_service without a tokenizer), is out of the
    collector's full passes: such a pass would stall a step loop (structgen.heap.freeze_heap)."""
    gc.unfreeze()
    before_start = [[]]
    config = GrammarServiceConfig(listen=f"unix://{tmp_path}/g.sock", shutdown_grace_s=0.5)
    running = RunningServer(config)
    client = GrammarControlClient(config.listen)
    chan = StepChannel.create(GEOMETRY)
    try:
        assert not _is_tracked_by_full_passes(before_start)
        before_load = [[]]
        client.open_channel(chan.name, GEOMETRY, max_slots=4, first_step=1, tokenizer_dir=mistral_32k_dir,
                            tokenizer_fingerprint=mistral_32k_fingerprint)
        assert not _is_tracked_by_full_passes(before_load)
        assert not _is_tracked_by_full_passes(running.service._backends["xgrammar"])
        after_load = [[]]
        client.close_channel(chan.name)
        client.open_channel(chan.name, GEOMETRY, max_slots=4, first_step=1, tokenizer_dir=mistral_32k_dir,
                            tokenizer_fingerprint=mistral_32k_fingerprint)  # no load: nothing frozen
        assert _is_tracked_by_full_passes(after_load)
    finally:
        client.close()
        running.stop()
        chan.close()
        gc.unfreeze()


def test_a_compile_waits_a_bounded_time_for_grammar_service_to_be_back(tmp_path, mistral_32k_dir):
    """What the engine's control client does while a standby takes over (grammar_contract/reconnect.py)."""
    config = GrammarServiceConfig(listen=f"unix://{tmp_path}/g.sock", tokenizer_dir=mistral_32k_dir,
                                  vocab_size=32768, shutdown_grace_s=0.5, isolate_compiles=False)
    impatient = GrammarControlClient(config.listen, reconnect_wait_s=0.3)
    patient = GrammarControlClient(config.listen, reconnect_wait_s=60)
    running = None
    try:
        with pytest.raises(GrammarUnavailableError, match="unreachable"):
            impatient.compile(GrammarSpec("regex", "a")).result(30)  # nothing listens, for good
        waiting = patient.compile(GrammarSpec("regex", "b+"))
        assert not waiting.done()
        running = RunningServer(config)  # comes up while the call waits
        assert waiting.result(60).grammar_id > 0
    finally:
        impatient.close()
        patient.close()
        if running is not None:
            running.stop()
