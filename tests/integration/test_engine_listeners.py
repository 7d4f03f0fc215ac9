"""Finish listeners (spans, metrics) run before the final event reaches the consumer: a
client holding its last message finds the request's histograms and spans recorded."""
from __future__ import annotations

import threading
import time

from generation_service.engine.params import GenerationRequest, SamplingParams
from tests.integration.test_engine_support import make_engine, shared_model


def test_finish_listeners_run_before_the_final_event_is_delivered():
    engine = make_engine(None, model=shared_model(), max_batch=2)
    recorded = threading.Event()

    def slow_listener(request) -> None:
        time.sleep(0.3)  # were the final event put first, the consumer would see it meanwhile
        recorded.set()

    engine.table.finish_listeners.append(slow_listener)
    try:
        ids = tuple(engine.tokenizer.encode("Hello there"))
        stream = engine.submit(GenerationRequest("listened", ids, SamplingParams(max_new_tokens=3)))
        final = [event for event in stream if event.is_final]
        assert final and final[0].usage.completion_tokens == 3
        assert recorded.is_set(), "the final event was delivered before the finish listeners ran"
    finally:
        engine.stop()
