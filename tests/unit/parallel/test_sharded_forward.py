"""Two gloo ranks serve the logits one process computes: the shard plan, the row-parallel
all-reduce (biases added once), the vocab-parallel embedding and LM head (a vocabulary that
does not divide, so the padded tail is cut) and the KV shards, over a prefill then decode
steps through the paged cache. The checkpoint is read slice by slice (loading.load_shard)."""
from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
from safetensors.torch import save_file

from generation_service.engine.kv_cache import KVCache
from generation_service.model.forward_batch import build_forward_batch
from generation_service.model.loader import load_model
from generation_service.model.random_init import build_random_model
from generation_service.parallel.plan import ShardPlan, TensorParallelError, check_divisible
from ports import free_port

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 101, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True, "eos_token_id": 2,
    "dtype": "float32",
}
PROMPTS = [[5, 17, 33, 99, 100, 42, 7], [64, 3, 88]]  # embedding rows of both ranks (51 rows each)
NUM_DECODE_STEPS = 4
PAGE_SIZE = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp-checkpoint")
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    config = load_model(f"random:{folder / 'config.json'}").config
    model = build_random_model(config, torch.device("cpu"), torch.float32, seed=3)
    generator = torch.Generator().manual_seed(4)
    state = {}
    for name, param in model.named_parameters():  # biases and norms nonzero, unlike random init
        state[name] = param.detach().clone() + (0.1 * torch.randn(param.shape, generator=generator)
                                                if name.endswith(("bias", "norm.weight")) else 0)
    save_file(state, str(folder / "model.safetensors"))
    return folder


def greedy_logits(model, kv: KVCache) -> list[torch.Tensor]:
    """Logits of a prefill of PROMPTS, then NUM_DECODE_STEPS greedy steps of both rows."""
    pages = [[1, 2, 3], [4, 5, 6]]
    new_ids, cached, out = [list(p) for p in PROMPTS], [0, 0], []
    for _ in range(1 + NUM_DECODE_STEPS):
        batch = build_forward_batch(new_ids, cached, pages)
        logits = model(batch, kv)
        out.append(logits)
        cached = [c + len(ids) for c, ids in zip(cached, new_ids)]
        tokens = logits.argmax(-1).tolist()
        new_ids = [[t] for t in tokens]
    return out


def _address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def run_worker(address: str, folder: str) -> None:
    from generation_service.parallel.worker import main
    raise SystemExit(main(["--rank", "1", "--world-size", "2", "--address", address, "--model-json",
                           json.dumps({"model": folder, "device": "cpu", "dtype": None, "seed": 0})]))


def test_two_gloo_ranks_give_the_single_process_logits(checkpoint):
    """Rank 1 is the real worker loop in a child; rank 0 runs here through the runner that
    broadcasts each step (a second child would import torch again)."""
    from generation_service.parallel.group import close_group, init_group
    from generation_service.parallel.loading import load_shard
    from generation_service.parallel.runner import TensorParallelRunner

    reference = load_model(str(checkpoint))
    config = reference.config
    kv = KVCache(config.num_layers, 8, PAGE_SIZE, config.num_kv_heads, config.head_dim, torch.float32, "cpu")
    with torch.inference_mode():
        expected = greedy_logits(reference.model, kv)
    address = _address()
    child = multiprocessing.get_context("spawn").Process(target=run_worker, args=(address, str(checkpoint)))
    child.start()
    num_threads = torch.get_num_threads()
    try:
        group = init_group(0, 2, address, "cpu")
        loaded = load_shard(str(checkpoint), group, None, 0)
        shard = loaded.model.config
        kv_shard = KVCache(shard.num_layers, 8, PAGE_SIZE, shard.num_kv_heads, shard.head_dim, torch.float32, "cpu")
        runner = TensorParallelRunner(loaded.model, kv_shard, config.vocab_size)
        with torch.inference_mode():
            got = greedy_logits(lambda batch, _kv: runner.forward(batch), kv_shard)
        runner.close()
        child.join(30)
    finally:
        close_group()
        torch.set_num_threads(num_threads)  # init_group split the cores between the ranks
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0  # the worker left its loop on STOP
    assert tuple(kv_shard.k[0].shape) == (8, PAGE_SIZE, 1, 16)  # each rank caches one of the 2 KV heads
    assert [tuple(g.shape) for g in got] == [tuple(e.shape) for e in expected] == [(2, 101)] * (1 + NUM_DECODE_STEPS)
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=f"step {step}")


def _config(**fields):
    folder_config = dict(HF_CONFIG, **fields)
    from generation_service.model.architectures import parse_hf_config
    return parse_hf_config(folder_config, "config.json")


def test_shapes_that_do_not_divide_are_refused_naming_the_dimension():
    with pytest.raises(TensorParallelError, match="4 attention heads do not divide over 3 ranks"):
        check_divisible(_config(), 3)
    with pytest.raises(TensorParallelError, match="2 KV heads do not divide over 4 ranks"):
        check_divisible(_config(), 4)
    with pytest.raises(TensorParallelError, match="100 MLP intermediate features"):
        check_divisible(_config(num_attention_heads=8, num_key_value_heads=8, head_dim=8, intermediate_size=100), 8)
    check_divisible(_config(), 2)


def test_shard_ranges_cover_each_split_tensor_once():
    config = _config()
    plans = [ShardPlan(rank, 2, config) for rank in (0, 1)]
    assert [p.shard_range("model.layers.0.self_attn.q_proj.weight", (64, 64)) for p in plans] == \
        [(0, slice(0, 32)), (0, slice(32, 64))]
    assert [p.shard_range("model.layers.1.mlp.down_proj.weight", (64, 96)) for p in plans] == \
        [(1, slice(0, 48)), (1, slice(48, 96))]
    # 101 rows: 51 per rank, the last one's 51st row is padding
    assert [p.shard_range("lm_head.weight", (101, 64)) for p in plans] == [(0, slice(0, 51)), (0, slice(51, 102))]
    assert plans[0].shard_range("model.layers.0.self_attn.o_proj.bias", (64,)) is None
    assert plans[0].shard_range("model.norm.weight", (64,)) is None
    assert plans[1].local.num_kv_heads == 1 and plans[1].local.intermediate_size == 48
