"""RequestStream: deferred wake-ups lose no event, and coalescing keeps order and the final last."""
from __future__ import annotations

import queue
import threading

import pytest

from generation_service.engine.errors import EngineError
from generation_service.engine.events import FinishReason, OutputEvent, TokenLogprob, Usage
from generation_service.engine.stream import LoopWaker, RequestStream, coalesce
from grammar_contract.report import GuaranteeReport


def tokens(*ids: int) -> OutputEvent:
    return OutputEvent.of_tokens(ids, "".join(f"<{i}>" for i in ids), tuple(TokenLogprob(i, -i) for i in ids))


def final(reason=FinishReason.MAX_TOKENS, error=None, ids=()) -> OutputEvent:
    return OutputEvent(ids, "", (), finish_reason=reason, usage=Usage(3, 5), error=error)


def new_stream() -> RequestStream:
    return RequestStream("r", lambda request_id: None)


def test_coalesce_merges_token_runs_in_order_and_keeps_the_final_apart():
    guarantee = OutputEvent(guarantee=GuaranteeReport("xgrammar"))
    events = [guarantee, tokens(1), tokens(2, 3), tokens(4), final(ids=(5,))]
    merged = coalesce(events)
    assert [e.guarantee for e in merged] == [guarantee.guarantee, None, None]
    assert merged[1].token_ids == (1, 2, 3, 4)
    assert merged[1].text == "<1><2><3><4>"
    assert [lp.token_id for lp in merged[1].logprobs] == [1, 2, 3, 4]
    assert merged[2] is events[-1] and merged[2].is_final and merged[2].token_ids == (5,)


def test_coalesce_never_moves_tokens_into_an_error():
    # server.Generate raises on an error event: tokens before it must still be sent first.
    error = final(FinishReason.ERROR, EngineError("boom"))
    merged = coalesce([tokens(1), tokens(2), error])
    assert [e.token_ids for e in merged] == [(1, 2), ()]
    assert merged[-1] is error


def test_pushed_events_wait_for_wake_and_come_as_one_batch():
    stream = new_stream()
    got: list[list[OutputEvent]] = []
    consumer = threading.Thread(target=lambda: got.extend(stream.batches()))
    consumer.start()
    for i in range(3):
        stream.push(tokens(i))
    stream.push(final())
    stream.wake()
    consumer.join(timeout=5)
    assert not consumer.is_alive()
    flat = [e for batch in got for e in batch]
    assert [e.token_ids for e in flat] == [(0,), (1,), (2,), ()]
    assert flat[-1].is_final and stream.is_finished


def test_get_times_out_then_returns_what_was_put():
    stream = new_stream()
    with pytest.raises(queue.Empty):
        stream.get(timeout=0.01)
    stream.put(tokens(7))
    assert stream.get(timeout=1).token_ids == (7,)


def test_no_wake_up_is_lost_under_contention():
    """A producer pushing a 'step' then waking races the consumer going to sleep each time."""
    stream, num_steps = new_stream(), 5000
    received: list[int] = []

    def consume():
        for event in stream.coalesced():
            received.extend(event.token_ids)

    consumer = threading.Thread(target=consume)
    consumer.start()
    for i in range(num_steps):
        stream.push(tokens(i))
        stream.wake()
    stream.put(final())
    consumer.join(timeout=30)
    assert not consumer.is_alive(), "the consumer slept through a wake-up"
    assert received == list(range(num_steps))


def test_an_asyncio_consumer_loses_no_wake_up_under_contention():
    """The same race for `acoalesced` on an event loop: the engine thread's wake-ups resume
    the task through the loop's LoopWaker."""
    import asyncio

    stream, num_steps = new_stream(), 5000
    received: list[int] = []

    async def consume():
        async for event in stream.acoalesced():
            received.extend(event.token_ids)

    async def main():
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)  # the consumer waits on the loop before the producer starts

        def produce():
            for i in range(num_steps):
                stream.push(tokens(i))
                stream.wake()
            stream.put(final())
        producer = threading.Thread(target=produce)
        producer.start()
        await asyncio.wait_for(task, timeout=30)
        producer.join()

    asyncio.run(main())
    assert received == list(range(num_steps))


def test_the_streams_woken_in_one_step_share_their_loop_calls():
    """A step wakes every stream that got events; their consumers resume through the loop
    calls (`call_soon_threadsafe`, a write to the loop's self-pipe) of the wake-ups that found
    none pending: one, or a few when the loop ran in between, not one each."""
    import asyncio

    streams = [new_stream() for _ in range(64)]
    calls: list[int] = []

    async def main():
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            if getattr(callback, "__self__", None) is LoopWaker.of(loop):  # (the executor calls it too)
                calls.append(1)
            return original(callback, *args, **kwargs)
        loop.call_soon_threadsafe = counted
        got: dict[int, list[int]] = {}

        async def consume(k, stream):
            async for event in stream.acoalesced():
                got.setdefault(k, []).extend(event.token_ids)
        tasks = [asyncio.ensure_future(consume(k, s)) for k, s in enumerate(streams)]
        await asyncio.sleep(0.01)  # every consumer waits

        def step():
            for k, stream in enumerate(streams):
                stream.push(tokens(k))
            for stream in streams:
                stream.wake()
        await loop.run_in_executor(None, step)
        await asyncio.sleep(0.05)
        assert sorted(got) == list(range(64)) and 1 <= len(calls) <= 4, (len(got), len(calls))
        for stream in streams:
            stream.put(final())
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)

    asyncio.run(main())
