"""Shared helpers of the GPU tests: small random Llama shapes, Tekken-131k vocab."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil

import torch

TOKENIZER_DIR = pathlib.Path(os.environ.get(
    "STRUCTGEN_TEKKEN_DIR", pathlib.Path.home() / ".cache/structgen/tokenizers/tekken_131k"))
VOCAB = 131072
PAGE_SIZE = 16


def small_config(num_layers: int = 2):
    from generation_service.model.presets import PRESETS
    return dataclasses.replace(PRESETS["llama-3.2-1b"], num_layers=num_layers, vocab_size=VOCAB,
                               max_position_embeddings=4096)


def make_kv(config, num_pages: int, seed: int = 1):
    """A paged cache filled with random K/V (never zeros: they hide indexing bugs)."""
    from generation_service.engine.kv_cache import KVCache
    kv = KVCache(config.num_layers, num_pages, PAGE_SIZE, config.num_kv_heads, config.head_dim,
                 torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for t in kv.k + kv.v:
        t.normal_(0.0, 1.0, generator=gen)
    return kv


def load_rows(runner, batch: int, context_len: int, pages_per_row: int, seed: int = 2):
    """Rows 0..batch-1: row r owns pages 1 + r*pages_per_row..., feeds a random token at
    position context_len (its first context_len positions are the random cache)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch,), generator=gen)
    positions = torch.full((batch,), context_len, dtype=torch.int64)
    seq_lens = torch.full((batch,), context_len + 1, dtype=torch.int32)
    table = torch.stack([torch.arange(1 + r * pages_per_row, 1 + (r + 1) * pages_per_row,
                                      dtype=torch.int32) for r in range(batch)])
    runner.load_rows(ids, positions, seq_lens, table)
    return ids, table


# ---- engine tests: a small random checkpoint, its engine config, greedy-output checks ----
NEW_TOKENS = 24
PROMPTS = ["The quick brown fox jumps over", "1 2 3 4 1 2 3", "Hello, my name is",
           "def f(x): return x + 1\ndef g(x):", "Write letters:"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "ok", "color"], "additionalProperties": False}


def write_random_checkpoint(folder: pathlib.Path, *, tied: bool = False, with_tokenizer: bool = True) -> str:
    """A 2-layer random Llama (bf16) config in `folder`, the Tekken-131k tokenizer files
    beside it when asked; returns the engine's model spec "random:<config.json>"."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
              "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "hidden_act": "silu",
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    if with_tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (TOKENIZER_DIR / name).is_file():
                shutil.copy(TOKENIZER_DIR / name, folder / name)
    return f"random:{folder / 'config.json'}"


def engine_config(model_spec: str, runner: str, **extra):
    from generation_service.engine.config import EngineConfig
    fields = dict(model=model_spec, device="cuda", dtype="bfloat16", runner=runner, max_batch=8,
                  num_pages=512, max_prompt_tokens=256, max_new_tokens_limit=256, seed=0)
    return EngineConfig(**fields | extra)


def run_engine(config, requests, grammar=None):
    """(engine, results, stats once settled) of one batch of `requests` (callables engine ->
    GenerationRequest); the engine is stopped on return."""
    from generation_service.engine.engine import Engine
    from tests.integration.test_engine_support import run_all, wait_settled
    engine = Engine(config, grammar)
    engine.start()
    try:
        results = run_all(engine, [make(engine) for make in requests])
        return engine, results, wait_settled(engine)
    finally:
        engine.stop()


def check_settled(stats) -> None:
    """Nothing left behind: every KV page, slot and grammar matcher is back."""
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0), stats


def greedy(i, prompt, **sampling):
    """A request factory: greedy, NEW_TOKENS tokens, EOS ignored (overridable)."""
    from generation_service.engine.params import GenerationRequest, SamplingParams
    sampling.setdefault("max_new_tokens", NEW_TOKENS)
    sampling.setdefault("ignore_eos", True)
    return lambda engine: GenerationRequest(f"r{i}", tuple(engine.tokenizer.encode(prompt)),
                                            SamplingParams(**sampling))


def teacher_forced_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """(len, vocab) float logits of every position of `token_ids` in one eager prefill."""
    from generation_service.engine.kv_cache import KVCache
    from generation_service.model.forward_batch import build_forward_batch
    mc = engine.model_config
    kv = KVCache(mc.num_layers, 64, 16, mc.num_kv_heads, mc.head_dim, torch.bfloat16, "cuda")
    pages = list(range(1, 1 + -(-len(token_ids) // 16)))
    fb = build_forward_batch([token_ids], [0], [pages], device="cuda", logits="all")
    with torch.no_grad():
        return engine.runner.model(fb, kv).float()


def same_or_near_tie(logits: torch.Tensor, num_prompt: int, a: list[int], b: list[int], what: str) -> bool:
    """True if the greedy outputs a and b are equal; else they must part at a bf16 near tie
    (`logits`: the teacher-forced logits along b, equal to a's up to the divergence)."""
    diverged = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if diverged is None:
        assert len(a) == len(b), what
        return True
    row = logits[num_prompt + diverged - 1]  # same prefix for both up to here
    tie = abs((row[a[diverged]] - row[b[diverged]]).item())
    print(f"{what[:20]!r}: diverged at token {diverged}, a bf16 near tie ({tie:.4f})")
    assert tie <= 0.1 * row.std().item() + 1e-3, (what, diverged, tie)
    return False


def check_greedy_rows(engine, prompts, reference, graph) -> int:
    """Every graph token is the argmax of an eager prefill up to bf16 noise, and each graph
    row equals its reference row up to a bf16 near tie. Returns the number identical."""
    num_identical = 0
    for prompt, e, g in zip(prompts, reference, graph):
        prompt_ids = list(engine.tokenizer.encode(prompt))
        logits = teacher_forced_logits(engine, prompt_ids + g.token_ids)
        for j, token in enumerate(g.token_ids):
            row = logits[len(prompt_ids) + j - 1]
            gap = (row.max() - row[token]).item()
            assert gap <= 0.1 * row.std().item() + 1e-3, (prompt, j, gap, row.std().item())
        num_identical += same_or_near_tie(logits, len(prompt_ids), e.token_ids, g.token_ids, prompt)
    return num_identical
