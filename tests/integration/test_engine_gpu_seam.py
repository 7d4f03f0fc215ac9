"""The engine's CUDA-graph seam on CPU: CudaGraphRunner over a fake GPU that does what the
captured step does (publish inputs_seq, forward, wait mask_seq, apply masks, sample, write
outputs + outputs_seq) on a thread, so the engine loop, `GrammarLink.begin(gpu=True)`,
`wait_gpu` and its watchdog run exactly as under graphs, with a real grammar_service."""
from __future__ import annotations

import threading
import types

import pytest
import torch

from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, GrammarSpec, SamplingParams
from generation_service.engine.sampler import unpack_bitmask
from generation_service.model.forward_batch import build_forward_batch
from tests.integration.test_engine_support import (
    collect, make_engine, run_all, shared_grammar_service, shared_model, start_grammar_service, wait_settled,
)


class FakeGpu:
    """GpuDecodeRunner's host interface; a step runs on a thread like a graph on a stream."""

    def __init__(self, model, kv, max_batch: int) -> None:
        self.model, self.kv, self.max_batch = model, kv, max_batch
        self.buffers = types.SimpleNamespace(page_table=torch.zeros(max_batch, 256, dtype=torch.int32),
                                             out_tokens=torch.zeros(max_batch, dtype=torch.int64))
        self.next_channel_step = 1
        self.channel = None
        self.graphs = types.SimpleNamespace(capture_s=0.0)
        self._thread: threading.Thread | None = None
        self.num_channel_steps = 0

    def load_rows(self, ids, positions, seq_lens, table) -> None:
        self.rows = (ids.tolist(), positions.tolist(), table.tolist())

    def load_sampling(self, start, temperature, seeds, top_k, top_p) -> None:
        pass

    def attach_channel(self, mapped, variants, first_step: int) -> None:
        self.close()
        self.channel = mapped.channel if mapped is not None else None
        self.next_channel_step = first_step

    def set_channel_step(self, step: int) -> None:
        self.next_channel_step = step

    def step(self, n: int, constrained: bool = False, filters: bool = False) -> None:
        self.close()
        step, chan = self.next_channel_step, self.channel if constrained else None
        if constrained:
            self.next_channel_step += 1
            self.num_channel_steps += 1
        self._thread = threading.Thread(target=self._body, args=(n, step, chan))
        self._thread.start()
        if not constrained:
            self.close()  # the runner's event sync

    def _body(self, n: int, step: int, chan) -> None:
        ids, positions, table = self.rows
        if chan is not None:
            chan.publish_seq("inputs_seq", step)
        pages = [[p for p in row if p] for row in table]
        fb = build_forward_batch([[t] for t in ids], positions, pages, device="cpu")
        with torch.inference_mode():
            logits = self.model(fb, self.kv).float()
        if chan is not None:
            assert chan.wait_seq("mask_seq", step, timeout_s=60)
            entry = chan.entry(step)
            g = chan.geometry
            masks = torch.from_numpy(entry.masks.reshape(g.max_batch, g.max_positions, -1)[:n, 0].copy())
            logits = logits.masked_fill(~unpack_bitmask(masks, logits.shape[1]), float("-inf"))
        tokens = logits.argmax(-1)
        self.buffers.out_tokens[:n] = tokens
        if chan is not None:
            entry.out_tokens[:n, 0] = tokens.numpy()
            entry.out_counts[:n] = 1
            chan.publish_seq("outputs_seq", step)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def graph_engine(monkeypatch, grammar_address, **config):
    """An engine whose runner is CudaGraphRunner over FakeGpu."""
    from generation_service.engine import graph_runner, runner
    from generation_service.engine.graph_runner import CudaGraphRunner

    def fake_init(self, model, kv_cache, vocab_size, *, max_batch, filters=True):
        runner.ModelRunner.__init__(self, model, kv_cache, vocab_size)
        self.filters, self.gpu, self.channel, self._mapped = filters, FakeGpu(model, kv_cache, max_batch), None, None
        self._host_tokens = torch.zeros(max_batch, dtype=torch.int64)
        self._tokens_ready = types.SimpleNamespace(record=lambda: None, synchronize=lambda: None)
        self.num_graph_steps = self.num_eager_steps = 0

    class FakeMapped:
        def __init__(self, channel):
            self.channel = channel

        @classmethod
        def register(cls, channel):
            return cls(channel)

        def close(self):
            pass

    monkeypatch.setattr(CudaGraphRunner, "__init__", fake_init)
    monkeypatch.setattr("step_channel.cuda.MappedChannel", FakeMapped)
    monkeypatch.setitem(runner.RUNNERS, "cuda_graph", CudaGraphRunner)
    assert graph_runner.CudaGraphRunner is CudaGraphRunner
    return make_engine(grammar_address, model=shared_model(), runner="cuda_graph", max_draft_tokens=0, **config)


def test_graph_steps_match_eager_and_grammar_steps_run_on_the_gpu_side(monkeypatch):
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
    engine = graph_engine(monkeypatch, address)
    try:
        results = run_all(engine, requests(engine))
        stats = wait_settled(engine)
    finally:
        engine.stop()
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
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


pytestmark = pytest.mark.timeout(300)
