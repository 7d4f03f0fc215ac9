"""GpuDecodeRunner: eager decode == the model's reference forward, graph replay == eager
(with padding rows), the mask prefetch (side stream) == the serial mask read (gathered or
read from the ring in place) under host masks published early and late, with the step tail
folded into the epilogue or not, and constrained JSON under graphs with grammar_service in
its own process (both mask reads)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from gpu_helpers import TOKENIZER_DIR, VOCAB, load_rows, make_kv
from generation_service.engine.cuda_graphs import SERVING_VARIANTS, with_serial
from generation_service.engine.gpu_runner import GpuDecodeRunner
from step_channel import FLAG_CONSTRAINED, FLAG_FRESH, Geometry, StepChannel

pytestmark = pytest.mark.gpu
CONTEXT = 40
PAGES_PER_ROW = 8  # 128 positions per row


@pytest.mark.parametrize("fused_ops", [True, False])
def test_eager_decode_matches_reference_forward(model, fused_ops):
    from generation_service.model.forward_batch import build_forward_batch
    batch = 3
    kv = make_kv(model.config, 1 + batch * PAGES_PER_ROW)
    runner = GpuDecodeRunner(model, kv, max_batch=4, buckets=(1, 2, 4), fused_ops=fused_ops)
    ids, table = load_rows(runner, batch, CONTEXT, PAGES_PER_ROW)
    ref_kv = make_kv(model.config, 1 + batch * PAGES_PER_ROW)  # same seed -> same contents
    fb = build_forward_batch([[int(t)] for t in ids], [CONTEXT] * batch, table.tolist(), device="cuda")
    with torch.no_grad():
        ref = model(fb, ref_kv)
        runner.buffers.scrub_tail(batch, 4)
        out = runner.decode_forward(4)[:batch].float()
    rel = ((out - ref).norm() / ref.norm()).item()
    print(f"fused_ops={fused_ops}: logits rel err vs reference {rel:.2e}")
    assert torch.isfinite(out).all() and rel < 2e-2, rel
    # the new K/V landed where the reference put them, padding row 3 only in the dummy page
    for layer in range(model.config.num_layers):
        live = kv.k[layer][1:]
        assert ((live.float() - ref_kv.k[layer][1:].float()).norm() / live.float().norm()).item() < 2e-2


@pytest.mark.parametrize("batch", [3, 8])
def test_graph_replay_equals_eager(model, batch):
    num_pages = 1 + 8 * PAGES_PER_ROW
    kv = make_kv(model.config, num_pages)
    runner = GpuDecodeRunner(model, kv, max_batch=8, buckets=(1, 2, 4, 8))
    start = [t.clone() for t in kv.k + kv.v]
    with torch.no_grad():
        load_rows(runner, batch, CONTEXT, PAGES_PER_ROW)
        eager = []
        for _ in range(6):
            runner.step(batch, use_graph=False)
            eager.append(runner.buffers.out_tokens[:batch].clone())
        for t, s in zip(kv.k + kv.v, start):
            t.copy_(s)
        runner.capture()
        load_rows(runner, batch, CONTEXT, PAGES_PER_ROW)
        graph = []
        for _ in range(6):
            runner.step(batch)
            graph.append(runner.buffers.out_tokens[:batch].clone())
    torch.cuda.synchronize()
    runner.close()
    assert torch.equal(torch.stack(eager), torch.stack(graph))
    assert len(set(torch.stack(graph).flatten().tolist())) > 1  # not a constant output


def pack_bits(allowed: torch.Tensor) -> np.ndarray:
    """(R, V) bool -> (R, V // 32) int32 words, token t at bit t % 32 of word t // 32."""
    rows, vocab = allowed.shape
    words = (allowed.view(rows, vocab // 32, 32).long() << torch.arange(32)).sum(-1)
    return words.to(torch.int64).numpy().astype(np.uint32).view(np.int32)


POISON = 7  # the only token the stale masks allow, and one the real masks never do
# GpuDecodeRunner switches read at capture: the step's channel work before the folds (memops
# for inputs_seq and the tail, torch.index_select's gather) and after them, with the mask
# gather's CTAs at the default, at one (one CTA walks every tile), mask_sample reading the ring, and
# (below 16 rows) the prefetch forked at the LM head
TAILS = {
    "memop-tail+index-select": dict(fold_inputs_seq=False, fold_step_tail=False, mask_gather_programs=0,
                                    ring_mask_read=False, prefetch_at_head=False),
    "folded-tail+ring-read": dict(fold_inputs_seq=True, fold_step_tail=True, mask_gather_programs=8,
                                  ring_mask_read=True, prefetch_at_head=False),
    "folded-tail+gather-1": dict(fold_inputs_seq=True, fold_step_tail=True, mask_gather_programs=1,
                                 ring_mask_read=False, prefetch_at_head=False),
    "folded-tail+at-head": dict(fold_inputs_seq=True, fold_step_tail=True, mask_gather_programs=4,
                                ring_mask_read=False, prefetch_at_head=True),
}


@pytest.mark.parametrize("batch,bucket", [(3, 4), (20, 32)])  # below and above prefetch_min_bucket
@pytest.mark.parametrize("late", [False, True], ids=["masks-early", "masks-late"])
def test_prefetch_and_serial_mask_reads_give_the_same_tokens(model, late, batch, bucket):
    """Host-written masks (a quarter of the vocab per row, a new draw per step), eager and
    graph, prefetch and serial, each step tail: the same tokens, each allowed by its step's
    mask, read by the host after outputs_seq = N (the ring wraps). masks-late: the entry
    holds stale masks (POISON only) when the step launches, the real ones and mask_seq
    arrive 20 ms later (long after the forward), so a mask read that ran before its wait,
    on either stream, would sample POISON; and an outputs_seq published before the outputs
    would hand the host the previous lap's tokens."""
    from step_channel.cuda import MappedChannel
    num_steps = 6
    geometry = Geometry(max_batch=bucket, max_positions=1, vocab_size=VOCAB, depth=4)
    chan = StepChannel.create(geometry)
    mapped = MappedChannel.register(chan)
    kv = make_kv(model.config, 1 + bucket * PAGES_PER_ROW)
    start = [t.clone() for t in kv.k + kv.v]
    runner = GpuDecodeRunner(model, kv, max_batch=bucket, buckets=tuple(sorted({1, 2, 4, bucket})), mapped=mapped,
                             variants=SERVING_VARIANTS + tuple(with_serial(v) for v in SERVING_VARIANTS))
    gen = torch.Generator().manual_seed(3)
    allowed = []
    for _ in range(num_steps):
        a = torch.rand(batch, VOCAB, generator=gen) < 0.25
        a[:, POISON] = False
        allowed.append(a)
    real = [np.concatenate([pack_bits(a), np.full((bucket - batch, VOCAB // 32), -1, np.int32)]) for a in allowed]
    stale = np.zeros((bucket, VOCAB // 32), np.int32)
    stale[:, POISON // 32] = 1 << (POISON % 32)
    runs = {}
    try:
        with torch.no_grad():
            for use_graph, tail in [(False, name) for name in TAILS] + [(True, name) for name in TAILS]:
                for key, value in TAILS[tail].items():
                    setattr(runner, key, value)
                if use_graph:  # both settings are read at capture
                    runner.close()
                    runner.capture()
                for prefetch in (True, False):
                    for t, s in zip(kv.k + kv.v, start):
                        t.copy_(s)
                    load_rows(runner, batch, CONTEXT, PAGES_PER_ROW)
                    tokens = []
                    for i in range(num_steps):
                        n = runner.next_channel_step
                        e = chan.entry(n)
                        e.desc_header[:] = (n, batch)
                        e.out_tokens[:] = -1  # the previous lap's outputs must not pass for this step's
                        e.out_counts[:] = 0

                        def publish(e=e, n=n, i=i):
                            e.masks[:bucket] = real[i]
                            chan.publish_seq("mask_seq", n)
                        timer = None
                        if late:  # a thread: a host sync inside an eager step could not deadlock
                            e.masks[:bucket] = stale
                            timer = threading.Timer(0.02, publish)
                            timer.start()
                        else:
                            publish()
                        runner.step(batch, constrained=True, use_graph=use_graph, prefetch=prefetch)
                        assert chan.wait_seq("outputs_seq", n, timeout_s=30), f"step {n} never finished"
                        if timer is not None:
                            timer.join()
                        assert chan.load_seq("inputs_seq") == n
                        tokens.append(e.out_tokens[:batch, 0].astype(np.int64))
                        assert (e.out_counts[:batch] == 1).all()
                    # the device counter and ring slot: the next step's, in every mode
                    n = runner.next_channel_step
                    assert runner.buffers.step.item() == n and runner.buffers.ring_slot.item() == n % geometry.depth
                    key = (use_graph, prefetch, tail)
                    runs[key] = np.stack(tokens)  # (num_steps, batch)
                    print(f"graph={use_graph} prefetch={prefetch} {tail} late={late}: {runs[key].T.tolist()}")
    finally:
        chan.publish_seq("mask_seq", runner.next_channel_step - 1)  # never leave the GPU waiting
        torch.cuda.synchronize()
        runner.close()
        mapped.close()
        chan.close()
    reference = runs[(False, False, "memop-tail+index-select")]  # eager, serial, index_select: the oldest body
    for key, got in runs.items():
        assert np.array_equal(got, reference), f"{key}: {got.tolist()} != {reference.tolist()}"
    for i in range(num_steps):
        for r in range(batch):
            assert allowed[i][r, int(reference[i, r])], f"step {i} row {r}: token {reference[i, r]} not allowed"
    assert len(set(reference.flatten().tolist())) > 1


SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["a", "bb", "ccc"]}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["kind", "ok", "tags"], "additionalProperties": False}


@pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").is_file(), reason="no Tekken tokenizer")
@pytest.mark.parametrize("use_graph", [True, False])
@pytest.mark.parametrize("mask_prefetch", [True, False], ids=["prefetch", "serial"])
def test_constrained_json_valid_with_grammar_service_process(model, tmp_path, use_graph, mask_prefetch):
    from tokenizers import Tokenizer
    from step_channel.cuda import MappedChannel
    batch, max_steps = 4, 80
    geometry = Geometry(max_batch=4, max_positions=1, vocab_size=VOCAB, depth=4)
    chan = StepChannel.create(geometry)
    mapped = MappedChannel.register(chan)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    proc = subprocess.Popen(
        [sys.executable, str(pathlib.Path(__file__).parent / "grammar_proc.py"), chan.name,
         str(TOKENIZER_DIR), str(VOCAB), str(batch), "1", str(schema)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    runner = None
    try:
        grammar_id = json.loads(proc.stdout.readline())["grammar_id"]
        kv = make_kv(model.config, 1 + batch * PAGES_PER_ROW)
        runner = GpuDecodeRunner(model, kv, max_batch=4, buckets=(1, 2, 4), mapped=mapped,
                                 mask_prefetch=mask_prefetch)
        if use_graph:
            runner.capture()
        load_rows(runner, batch, CONTEXT, PAGES_PER_ROW)
        tokens = [[] for _ in range(batch)]
        done = [False] * batch
        with torch.no_grad():
            for i in range(max_steps):
                n = runner.next_channel_step
                e = chan.entry(n)
                e.desc_header[:] = (n, batch)
                for r in range(batch):
                    e.desc_rows[r] = (r, 1, FLAG_CONSTRAINED | (FLAG_FRESH if i == 0 else 0), grammar_id)
                runner.step(batch, constrained=True, use_graph=use_graph)
                # the host learns the tokens from the outputs area, without a device sync
                assert chan.wait_seq("outputs_seq", n, timeout_s=30), f"step {n} never finished"
                assert chan.load_seq("inputs_seq") == n
                for r in range(batch):
                    if not done[r]:
                        tokens[r].append(int(e.out_tokens[r, 0]))
                if i > 0:  # results of step n-1 arrive with the masks of step n
                    assert chan.wait_seq("mask_seq", n, timeout_s=30)
                    for r in range(batch):
                        terminated_at, error = chan.entry(n).results[r]
                        assert error == 0, f"row {r}: grammar error {error} at step {n - 1}"
                        if terminated_at >= 0 and not done[r]:
                            done[r] = True
                            tokens[r].pop()  # the step-n token came after the end
                if all(done):
                    break
        assert all(done), f"rows still open after {max_steps} steps: {done}"
        tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
        for r in range(batch):
            text = tok.decode(tokens[r][:-1])  # the last accepted token is the stop token
            doc = json.loads(text)
            assert set(doc) == {"kind", "ok", "tags"} and doc["kind"] in ("a", "bb", "ccc"), text
            assert isinstance(doc["ok"], bool) and len(doc["tags"]) <= 3, text
    finally:
        if runner is not None:
            chan.publish_seq("mask_seq", runner.next_channel_step - 1)  # never leave the GPU waiting
            torch.cuda.synchronize()
            runner.close()
        proc.stdin.close()
        proc.wait(30)
        mapped.close()
        chan.close()
