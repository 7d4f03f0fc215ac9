"""Tensor parallelism over NCCL (needs 2 GPUs; skipped with fewer): two ranks give the
single-GPU logits of the llama-3.1-8b shape (random fp32 weights, teacher-forced steps), and
`structgen serve --device cuda --tensor-parallel 2` gives the greedy tokens of one GPU's eager
runner, free and constrained.

    STRUCTGEN_TEKKEN_DIR=... python -m pytest -q -m gpu tests/gpu/test_tensor_parallel_gpu.py
"""
from __future__ import annotations

import json
import multiprocessing
import re
import subprocess
import sys

import pytest
import torch
from ports import free_port

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

SHAPE = "llama-3.1-8b"
PROMPTS = [[128000, 791, 6864, 315, 9822, 374], [128000, 755, 76798, 1471, 997]]
NUM_DECODE_STEPS = 4
PAGE_SIZE = 16


def _address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def steps_logits(model, kv, forced: list[list[int]] | None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """A prefill of PROMPTS then NUM_DECODE_STEPS steps fed `forced` tokens (None: greedy)."""
    from generation_service.model.forward_batch import build_forward_batch
    pages = [[1, 2], [3, 4]]
    new_ids, cached, logits_out, fed = [list(p) for p in PROMPTS], [0, 0], [], []
    for step in range(1 + NUM_DECODE_STEPS):
        logits = model(build_forward_batch(new_ids, cached, pages, device="cuda"), kv)
        logits_out.append(logits.float().cpu())
        cached = [c + len(ids) for c, ids in zip(cached, new_ids)]
        tokens = forced[step] if forced is not None else logits.argmax(-1).tolist()
        fed.append(tokens)
        new_ids = [[t] for t in tokens]
    return logits_out, fed


def run_worker(address: str) -> None:
    from generation_service.parallel.worker import main
    raise SystemExit(main(["--rank", "1", "--world-size", "2", "--address", address, "--model-json",
                           json.dumps({"model": f"random:{SHAPE}", "device": "cuda", "dtype": "float32",
                                       "seed": 0})]))


def test_nccl_ranks_give_the_single_gpu_logits_of_the_8b_shape():
    from generation_service.engine.kv_cache import KVCache
    from generation_service.model.presets import PRESETS
    from generation_service.model.random_init import build_random_model
    from generation_service.parallel.group import close_group, init_group
    from generation_service.parallel.loading import load_shard
    from generation_service.parallel.runner import TensorParallelRunner

    config = PRESETS[SHAPE]
    with torch.inference_mode():
        reference = build_random_model(config, torch.device("cuda:0"), torch.float32, seed=0)
        kv = KVCache(config.num_layers, 8, PAGE_SIZE, config.num_kv_heads, config.head_dim, torch.float32, "cuda:0")
        expected, tokens = steps_logits(reference, kv, None)
    del reference, kv
    torch.cuda.empty_cache()
    address = _address()
    child = multiprocessing.get_context("spawn").Process(target=run_worker, args=(address,))
    child.start()
    try:
        group = init_group(0, 2, address, "cuda")
        loaded = load_shard(f"random:{SHAPE}", group, "float32", 0)
        shard = loaded.model.config
        kv = KVCache(shard.num_layers, 8, PAGE_SIZE, shard.num_kv_heads, shard.head_dim, torch.float32, "cuda:0")
        runner = TensorParallelRunner(loaded.model, kv, config.vocab_size)
        with torch.inference_mode():
            got, _ = steps_logits(lambda batch, _kv: runner.forward(batch), kv, tokens)
        runner.close()
        child.join(120)
    finally:
        close_group()
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    for step, (g, e) in enumerate(zip(got, expected)):
        scale = e.abs().max().item()
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-3 * scale, msg=f"step {step}")
        assert (g.argmax(-1) == e.argmax(-1)).all(), f"step {step}"


def test_serve_on_two_gpus_gives_the_tokens_of_one(tmp_path):
    from tests.integration.live_server import start_serve, stop_serve
    from structgen_client import Client

    common = ["--device", "cuda", "--model", "tiny-random", "--max-new-tokens-limit", "64"]
    one = start_serve([*common, "--runner", "eager"], tmp_path / "tp1.log")
    two = start_serve([*common, "--tensor-parallel", "2"], tmp_path / "tp2.log")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    try:
        outputs = []
        for server in (one, two):
            with Client(server.address, timeout=120) as client:
                outputs.append([client.generate_text("The capital of France is", max_tokens=16, temperature=0),
                                client.generate_text("Write a code", max_tokens=24, temperature=0,
                                                     regex=r"[A-Z]{3}-[0-9]{2,4}"),
                                client.generate_text("A number", max_tokens=24, temperature=0,
                                                     json_schema=schema, compact=True)])
        for a, b in zip(*outputs):
            assert a.token_ids == b.token_ids
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", outputs[1][1].text)
        assert outputs[1][2].validation.valid
    finally:
        assert stop_serve(two) == 0
        stop_serve(one)


def test_more_ranks_than_gpus_are_refused():
    n = torch.cuda.device_count() + 1
    proc = subprocess.run([sys.executable, "-m", "structgen.cli", "serve", "--port", "0", "--device", "cuda",
                           "--model", "tiny-random", "--tensor-parallel", str(n)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"--tensor-parallel {n}: only {n - 1} CUDA device(s) are visible" in proc.stderr
