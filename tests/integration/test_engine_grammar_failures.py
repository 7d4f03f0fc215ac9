"""grammar_service dies mid-stream: constrained requests fail UNAVAILABLE, free ones finish,
nothing leaks, and the engine reconnects once grammar_service is back."""
from __future__ import annotations

import os
import signal
import time

import pytest

from generation_service.engine.errors import ShuttingDownError
from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams
from grammar_contract.spec import GrammarSpec
from tests.integration.test_engine_support import (
    collect, make_engine, start_grammar_service, wait_settled,
)


@pytest.fixture
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("grammar")


def interrupt_mid_stream(engine, action, num_disconnects):
    """2 free + 2 constrained requests stream; `action` breaks grammar_service; then check."""
    prompt = tuple(engine.tokenizer.encode("Write letters:"))
    free = [engine.submit(GenerationRequest(f"free{i}-{num_disconnects}", prompt,
                                            SamplingParams(max_new_tokens=48, ignore_eos=True)))
            for i in range(2)]
    constrained = [engine.submit(GenerationRequest(
        f"con{i}-{num_disconnects}", prompt, SamplingParams(max_new_tokens=48),
        grammar=GrammarSpec("regex", "[a-z]{300}"))) for i in range(2)]
    for stream in free + constrained:
        while not stream.get(timeout=60).token_ids:
            pass
    action()
    for stream in constrained:
        result = collect(stream)
        assert result.finish_reason is FinishReason.ERROR
        assert result.error.status == "UNAVAILABLE", result.error
    for stream in free:
        result = collect(stream)
        assert result.finish_reason is FinishReason.MAX_TOKENS and result.usage.completion_tokens == 48
    stats = wait_settled(engine)
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0)
    assert stats.grammar_disconnects == num_disconnects


def wait_reconnected_and_constrained_works(engine, address):
    from grammar_contract.client import GrammarControlClient

    deadline = time.monotonic() + 60
    while not engine.stats().grammar_available:
        assert time.monotonic() < deadline, "engine did not reconnect to grammar_service"
        time.sleep(0.1)
    prompt = tuple(engine.tokenizer.encode("Pick:"))
    again = collect(engine.submit(GenerationRequest(
        f"again-{time.monotonic()}", prompt, SamplingParams(max_new_tokens=8),
        grammar=GrammarSpec("choice", choices=("x", "y")))))
    assert again.error is None and again.text in ("x", "y")
    stats = wait_settled(engine)
    assert (stats.num_slots_used, stats.num_grammar_matchers) == (0, 0)
    client = GrammarControlClient(address)
    assert client.stats()["num_channels"] == 1  # a stuck service's old channel was closed
    assert client.stats()["num_bound_matchers"] == 0
    client.close()


def test_stuck_then_dead_grammar_service_fails_constrained_only_and_reconnects(folder):
    service = start_grammar_service(folder)
    engine = make_engine(service.address, max_batch=8, grammar_wait_timeout_s=1.0)
    try:
        pid = service.process.pid
        interrupt_mid_stream(engine, lambda: os.kill(pid, signal.SIGSTOP), 1)  # stuck: no heartbeat
        os.kill(pid, signal.SIGCONT)
        wait_reconnected_and_constrained_works(engine, service.address)

        interrupt_mid_stream(engine, service.kill, 2)  # dead: its process is gone
        prompt = tuple(engine.tokenizer.encode("hi"))
        while_down = collect(engine.submit(GenerationRequest(
            "down", prompt, SamplingParams(max_new_tokens=8), grammar=GrammarSpec("choice", choices=("x", "y")))))
        assert while_down.error is not None and while_down.error.status == "UNAVAILABLE"
        late_free = collect(engine.submit(GenerationRequest("late-free", prompt, SamplingParams(max_new_tokens=8))))
        assert late_free.finish_reason is FinishReason.MAX_TOKENS
        service = start_grammar_service(folder)
        wait_reconnected_and_constrained_works(engine, service.address)
    finally:
        os.kill(service.process.pid, signal.SIGCONT)
        engine.stop()
        service.stop()


def test_no_grammar_service_deadline_and_drain():
    engine = make_engine(None, max_batch=2)
    prompt = tuple(engine.tokenizer.encode("hi"))
    try:
        result = collect(engine.submit(GenerationRequest(
            "c", prompt, SamplingParams(max_new_tokens=4), grammar=GrammarSpec("regex", "a+"))))
        assert result.error.status == "UNAVAILABLE" and result.token_ids == []
        late = collect(engine.submit(GenerationRequest("late", prompt, SamplingParams(max_new_tokens=4),
                                                       deadline=time.monotonic() - 1)))
        assert late.finish_reason is FinishReason.DEADLINE and late.error.status == "DEADLINE_EXCEEDED"
        long = engine.submit(GenerationRequest("long", prompt, SamplingParams(max_new_tokens=1000, ignore_eos=True)))
        short = engine.submit(GenerationRequest("short", prompt, SamplingParams(max_new_tokens=4)))
        while not long.get(timeout=60).token_ids:
            pass
    finally:
        engine.stop(grace_s=1.0)  # short finishes within the grace period, long is cancelled
    assert collect(short).finish_reason is FinishReason.MAX_TOKENS
    drained = collect(long)
    assert drained.finish_reason is FinishReason.CANCELLED and drained.error.status == "UNAVAILABLE"
    assert 0 < drained.usage.completion_tokens < 1000
    with pytest.raises(ShuttingDownError):
        engine.submit(GenerationRequest("after", prompt))
    stats = engine.stats()
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_running) == (0, 0, 0)


def test_grammar_service_dying_mid_chain_fails_constrained_only(folder):
    """Pipelined steps (pipeline_mixed), whose grammar steps run in the step's own order
    (engine/stream_channel.py): the watchdog releases the step that waits for its masks, and the
    link reconnects as for host grammar steps."""
    service = start_grammar_service(folder)
    engine = make_engine(service.address, max_batch=8, grammar_wait_timeout_s=1.0, pipeline_mixed=True)
    try:
        interrupt_mid_stream(engine, service.kill, 1)
        service = start_grammar_service(folder)
        wait_reconnected_and_constrained_works(engine, service.address)
    finally:
        engine.stop()
        service.stop()
