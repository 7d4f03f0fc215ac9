"""The engine's CUDA-graph seam on CPU: CudaGraphRunner over a fake GPU that does what the
captured step does (publish inputs_seq, forward, wait mask_seq, apply masks, sample, write
outputs + outputs_seq) on a thread, so the engine loop, `GrammarLink.begin(gpu=True)`,
`wait_gpu` and its watchdog run exactly as under graphs, with a real grammar_service."""
from __future__ import annotations

import queue
import threading
import types

import pytest
import torch

from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams
from generation_service.engine.sampler import unpack_bitmask
from generation_service.engine.scheduler import ScheduledBatch
from generation_service.model.forward_batch import build_forward_batch
from grammar_contract.spec import GrammarSpec
from tests.integration.test_engine_support import (
    collect, make_engine, run_all, shared_grammar_service, shared_model, start_grammar_service, wait_settled,
)


class FakeGpu:
    """GpuDecodeRunner's host interface. Steps run in order on one worker thread, like graphs
    on a stream: a launch returns at once, and each step feeds its tokens back into the
    buffers as the captured body does (a chained launch under overlap reads them)."""

    def __init__(self, model, kv, max_batch: int) -> None:
        self.model, self.kv, self.max_batch = model, kv, max_batch
        self.buffers = types.SimpleNamespace(
            input_ids=torch.zeros(max_batch, dtype=torch.int64), positions=torch.zeros(max_batch, dtype=torch.int64),
            seq_lens=torch.zeros(max_batch, dtype=torch.int32), page_table=torch.zeros(max_batch, 256, dtype=torch.int32),
            out_tokens=torch.zeros(max_batch, dtype=torch.int64))
        self.next_channel_step = 1
        self.channel = None
        self.graphs = types.SimpleNamespace(capture_s=0.0)
        self._stream: queue.Queue = queue.Queue()
        threading.Thread(target=self._worker, daemon=True).start()
        self.num_channel_steps = 0

    def _worker(self) -> None:
        while True:
            self._stream.get()()
            self._stream.task_done()

    def load_rows(self, ids, positions, seq_lens, table) -> None:
        self.close()  # the host's copies are ordered after the running step
        b, n = self.buffers, ids.shape[0]
        b.input_ids[:n], b.positions[:n], b.seq_lens[:n] = ids, positions, seq_lens
        b.page_table[:n].zero_()
        b.page_table[:n, :table.shape[1]] = table

    def load_sampling(self, start, temperature, seeds, top_k, top_p) -> None:
        pass

    def attach_channel(self, mapped, variants, first_step: int) -> None:
        self.close()
        self.channel = mapped.channel if mapped is not None else None
        self.next_channel_step = first_step

    def set_channel_step(self, step: int) -> None:
        self.next_channel_step = step

    def step(self, n: int, constrained: bool = False, filters: bool = False) -> None:
        step, chan = self.next_channel_step, self.channel if constrained else None
        if constrained:
            self.next_channel_step += 1
            self.num_channel_steps += 1
        self._stream.put(lambda: self._body(n, step, chan))
        if not constrained:
            self.close()  # the runner's event sync

    def _body(self, n: int, step: int, chan) -> None:
        b = self.buffers
        ids, positions = b.input_ids[:n].tolist(), b.positions[:n].tolist()
        if chan is not None:
            chan.publish_seq("inputs_seq", step)
        pages = [[p for p in row if p] for row in b.page_table[:n].tolist()]
        fb = build_forward_batch([[t] for t in ids], positions, pages, device="cpu")
        with torch.inference_mode():
            logits = self.model(fb, self.kv).float()
        if chan is not None:
            while not chan.wait_seq("mask_seq", step, timeout_s=60):  # the device waits forever
                pass
            entry = chan.entry(step)
            g = chan.geometry
            masks = torch.from_numpy(entry.masks.reshape(g.max_batch, g.max_positions, -1)[:n, 0].copy())
            logits = logits.masked_fill(~unpack_bitmask(masks, logits.shape[1]), float("-inf"))
        tokens = logits.argmax(-1)
        b.out_tokens[:n] = tokens
        if chan is not None:
            entry.out_tokens[:n, 0] = tokens.numpy()
            entry.out_counts[:n] = 1
            chan.publish_seq("outputs_seq", step)
        live = b.seq_lens[:n] > 0
        b.input_ids[:n] = tokens
        b.positions[:n] += live
        b.seq_lens[:n] += live.int()

    def close(self) -> None:
        self._stream.join()


def graph_engine(monkeypatch, grammar_address, **config):
    """An engine whose runner is CudaGraphRunner over FakeGpu."""
    from generation_service.engine import graph_runner, runner, runners
    from generation_service.engine.graph_runner import CudaGraphRunner

    def fake_init(self, model, kv_cache, vocab_size, *, max_batch, filters=True, verify_width=0,
                  max_context_tokens=0):  # no verify or mixed graphs
        runner.ModelRunner.__init__(self, model, kv_cache, vocab_size)
        self.filters, self.gpu, self.channel, self._mapped = filters, FakeGpu(model, kv_cache, max_batch), None, None
        self._host_tokens = [torch.zeros(max_batch, dtype=torch.int64) for _ in range(2)]
        self._copy_ready = [types.SimpleNamespace(record=lambda: None, synchronize=lambda: None)] * 2
        self._next_copy, self._num_loaded_pages = 0, []
        self.num_graph_steps = self.num_chained_steps = self.num_mixed_steps = self.num_verify_steps = 0
        # mixed steps through the eager runner's model forward (the fused MixedForward needs CUDA)
        self.mixed = lambda rows, fed_back=None: runner.ModelRunner.run(self, ScheduledBatch(rows), fed_back)
        self.verify = self.mixed_graphs = self._draft_graphs = None

    class FakeMapped:
        def __init__(self, channel):
            self.channel = channel

        @classmethod
        def register(cls, channel):
            return cls(channel)

        def close(self):
            pass

    monkeypatch.setattr(CudaGraphRunner, "__init__", fake_init)
    # the mixed steps' grammar steps in the host's order, as on any CPU runner (no region to register)
    monkeypatch.setattr(CudaGraphRunner, "stream_channel", runner.ModelRunner.stream_channel)
    monkeypatch.setattr("step_channel.cuda.MappedChannel", FakeMapped)
    monkeypatch.setitem(runners.RUNNERS, "cuda_graph", CudaGraphRunner)
    assert graph_runner.CudaGraphRunner is CudaGraphRunner
    config.setdefault("prefill_chunk_tokens", 512)  # not measured: FakeGpu has no device to time
    config.setdefault("max_step_stretch", 0)       # (nor the step-time cap's cost)
    return make_engine(grammar_address, model=shared_model(), runner="cuda_graph", max_draft_tokens=0, **config)


def run_graph_engine(monkeypatch, grammar_address, requests, **config):
    """(engine, results, stats once settled) of one batch through graph_engine; stopped after."""
    engine = graph_engine(monkeypatch, grammar_address, **config)
    try:
        results = run_all(engine, requests(engine))
        return engine, results, wait_settled(engine)
    finally:
        engine.stop()


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_graph_steps_match_eager_and_grammar_steps_run_on_the_gpu_side(monkeypatch, overlap):
    import json

    import jsonschema
    from tests.integration.test_engine_generation import SCHEMA, json_grammar

    address = shared_grammar_service().address
    requests = lambda engine: [  # noqa: E731
        GenerationRequest("free", tuple(engine.tokenizer.encode("Hello, my name is")),
                          SamplingParams(max_new_tokens=16, ignore_eos=True)),
        GenerationRequest("json", tuple(engine.tokenizer.encode("Write:")), SamplingParams(max_new_tokens=120),
                          grammar=json_grammar())]
    eager = make_engine(address, model=shared_model(), runner="eager")
    try:
        expected = run_all(eager, requests(eager))
    finally:
        eager.stop()
    engine = graph_engine(monkeypatch, address, overlap=overlap)
    try:  # the channel's graphs are captured at start, not in the first constrained step
        assert engine.runner.channel is engine.link.channel is not None
        assert engine.runner.gpu.next_channel_step == engine.link.next_step
        results = run_all(engine, requests(engine))
        stats = wait_settled(engine)
    finally:
        engine.stop()
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert (engine.runner.num_chained_steps > 10) is overlap
    assert stats.num_chained_steps >= engine.runner.num_chained_steps  # the engine's stats count them
    assert results[1].finish_reason is FinishReason.GRAMMAR_COMPLETE
    jsonschema.validate(json.loads(results[1].text), SCHEMA)
    assert engine.runner.num_graph_steps >= 15 and engine.runner.gpu.num_channel_steps >= 5
    assert (stats.num_slots_used, stats.num_grammar_matchers) == (0, 0)


def test_watchdog_releases_a_gpu_step_waiting_for_a_dead_grammar_service(monkeypatch, tmp_path):
    from tests.integration.test_engine_grammar_failures import interrupt_mid_stream

    service = start_grammar_service(tmp_path)
    engine = graph_engine(monkeypatch, service.address, grammar_wait_timeout_s=1.0)
    try:
        interrupt_mid_stream(engine, service.kill, num_disconnects=1)
        assert engine.runner.channel is None and engine.runner.gpu.num_channel_steps > 0
        after = collect(engine.submit(GenerationRequest(
            "after", tuple(engine.tokenizer.encode("Again")), SamplingParams(max_new_tokens=4, ignore_eos=True))))
        assert after.finish_reason is FinishReason.MAX_TOKENS
    finally:
        engine.stop()
        service.stop()


def test_overlap_ends_rows_exactly_where_serial_steps_do(monkeypatch):
    """Rows that end inside a chain of overlapped steps (token limit, stop token, grammar
    complete, stop string; a cancel: the next test) end exactly as without overlap: same
    tokens, text and reasons; the token computed past a row's end is dropped; pages, slots,
    matchers return."""
    import json

    import jsonschema
    from tests.integration.test_engine_generation import SCHEMA, json_grammar

    address = shared_grammar_service().address

    def requests(engine):
        prompt = tuple(engine.tokenizer.encode("Hello, my name is"))
        return [GenerationRequest("short", prompt, SamplingParams(max_new_tokens=3, ignore_eos=True)),
                GenerationRequest("long", prompt, SamplingParams(max_new_tokens=40, ignore_eos=True)),
                GenerationRequest("stop-token", prompt, SamplingParams(max_new_tokens=40, ignore_eos=True,
                                                                        stop_token_ids=(serial_ids[1][7],))),
                GenerationRequest("stop-string", prompt, SamplingParams(max_new_tokens=40, ignore_eos=True,
                                                                         stop_strings=(serial_text[1][12:15],))),
                GenerationRequest("json", tuple(engine.tokenizer.encode("Write:")),
                                  SamplingParams(max_new_tokens=120), grammar=json_grammar()),
                GenerationRequest("json-capped", tuple(engine.tokenizer.encode("Write:")),
                                  SamplingParams(max_new_tokens=30), grammar=json_grammar())]

    serial_ids, serial_text = {1: [0] * 8}, {1: "x" * 15}
    engine = graph_engine(monkeypatch, address, overlap=False)
    try:  # the free row alone first: its tokens pick the stop token and stop string
        first = run_all(engine, requests(engine)[1:2])[0]
        serial_ids[1], serial_text[1] = first.token_ids, first.text
        serial = run_all(engine, requests(engine))
    finally:
        engine.stop()
    engine, overlapped, stats = run_graph_engine(monkeypatch, address, requests, overlap=True)
    assert engine.runner.num_chained_steps > 10
    for a, b in zip(serial, overlapped):
        assert (b.token_ids, b.text, b.finish_reason, b.usage) == (a.token_ids, a.text, a.finish_reason, a.usage)
    reasons = [r.finish_reason for r in overlapped]
    assert reasons[:5] == [FinishReason.MAX_TOKENS, FinishReason.MAX_TOKENS, FinishReason.STOP_TOKEN,
                           FinishReason.STOP_STRING, FinishReason.GRAMMAR_COMPLETE]
    # the capped document closes within its budget (grammar_service steers it), mid-chain too
    assert reasons[5] in (FinishReason.BUDGET_CLOSED, FinishReason.GRAMMAR_COMPLETE), overlapped[5]
    for document in overlapped[4:]:
        jsonschema.validate(json.loads(document.text), SCHEMA)
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0)


def test_cancel_during_overlapped_steps(monkeypatch):
    address = shared_grammar_service().address
    engine = graph_engine(monkeypatch, address, overlap=True)
    try:
        prompt = tuple(engine.tokenizer.encode("Write letters:"))
        streams = [engine.submit(GenerationRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=60),
                                                   grammar=GrammarSpec("regex", "[a-z]{300}")))
                   for i in range(3)]
        got = 0
        while got < 10:
            got += len(streams[1].get(timeout=60).token_ids)
        engine.cancel("r1")
        results = [collect(s) for s in streams]
        stats = wait_settled(engine)
    finally:
        engine.stop()
    assert results[1].finish_reason is FinishReason.CANCELLED
    for r in (results[0], results[2]):  # the others go on to a whole match or the token limit
        assert r.text.isalpha() and r.error is None
        assert (len(r.text) == 300 if r.finish_reason is FinishReason.GRAMMAR_COMPLETE
                else r.finish_reason is FinishReason.MAX_TOKENS and len(r.token_ids) == 60)
    assert engine.runner.num_chained_steps > 40
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0)


pytestmark = pytest.mark.timeout(300)
