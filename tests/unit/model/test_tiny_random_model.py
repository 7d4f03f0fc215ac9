"""The built-in tiny-random model: built once, atomically, then loaded like any checkpoint."""

from __future__ import annotations

import json
import sys
import time

import pytest

import torch
import transformers

from generation_service.model.config import ModelLoadError
from generation_service.model.tiny_random_model import ensure_tiny_random_model
from generation_service.model.loader import load_model
from generation_service.model.reference_generate import greedy_generate
from structgen.cache_dir import cache_root


def test_is_an_ordinary_checkpoint(tiny_random_path):
    names = sorted(p.name for p in tiny_random_path.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    assert not [p for p in tiny_random_path.parent.iterdir() if p.name.startswith(".")]  # no staging left
    config = json.loads((tiny_random_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 32000


def test_loads_fast_and_generates(tiny_random_path):
    start = time.perf_counter()
    loaded = load_model(str(tiny_random_path))
    assert time.perf_counter() - start < 5
    assert loaded.config.num_kv_heads == 2 and loaded.tokenizer.vocab_size == 32000
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Give me JSON"}])
    result = greedy_generate(loaded.model, loaded.config, [prompt], 8)
    assert len(result.output_ids[0]) == 8 and torch.isfinite(result.prefill_logits).all()


def test_is_seeded_the_same_every_time(tiny_random_path, tmp_path):
    again = ensure_tiny_random_model(tmp_path / "tiny-random-v2")
    assert (again / "model.safetensors").read_bytes() == (tiny_random_path / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (tiny_random_path / "tokenizer.json").read_bytes()


def test_existing_folder_is_reused(tiny_random_path):
    stamp = (tiny_random_path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_random_model(tiny_random_path) == tiny_random_path
    assert (tiny_random_path / "model.safetensors").stat().st_mtime_ns == stamp


def test_transformers_reads_it_identically(tiny_random_path):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_random_path)).eval()
    loaded = load_model(str(tiny_random_path))
    prompt = loaded.tokenizer.encode("The quick brown fox")
    result = greedy_generate(loaded.model, loaded.config, [prompt], 1)
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt])).logits[0, -1]
    assert (result.prefill_logits[0] - reference).abs().max() < 1e-4


def test_cache_dir_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("STRUCTGEN_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("STRUCTGEN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "structgen"


def test_missing_models_extra_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mistral_common", None)  # import now raises ImportError
    with pytest.raises(ModelLoadError, match=r"building the tiny-random model needs mistral_common: "
                                             r"pip install 'structgen\[models\]'"):
        ensure_tiny_random_model(tmp_path / "tiny-random-v2")
    assert not list(tmp_path.iterdir())


def test_racing_creator_that_wins_is_kept(monkeypatch, tmp_path, tiny_random_path):
    """Another process renames its finished folder into place while this one is still writing."""
    import shutil

    from generation_service.model import tiny_random_model

    target = tmp_path / "tiny-random-v2"

    def slow_write(staging):
        shutil.copytree(tiny_random_path, target)  # the other process wins the rename
        (staging / "config.json").write_text("{}")

    monkeypatch.setattr(tiny_random_model, "write_tiny_random_model", slow_write)
    assert ensure_tiny_random_model(target) == target
    assert json.loads((target / "config.json").read_text())["vocab_size"] == 32000  # the winner's files
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-random-v2"]  # our staging folder is gone
