"""Layer-skip calibration (model/layer_skip.py): a deterministic choice, cached per model."""
from __future__ import annotations

import pytest
import torch

from generation_service.model.layer_skip import (
    DEFAULT_TEXT, calibrate, choice_path, load_choice, model_key, store_choice,
)
from generation_service.model.loader import load_model


@pytest.fixture(scope="module")
def tiny(tiny_random_path):
    loaded = load_model(str(tiny_random_path))
    texts = [loaded.tokenizer.encode(part)[:64] for part in DEFAULT_TEXT.read_text().split("\n===\n")]
    return loaded, texts


def test_calibration_picks_a_deterministic_set(tiny):
    loaded, texts = tiny
    first = calibrate(loaded.model, texts, "tiny", num_draft_tokens=4)
    second = calibrate(loaded.model, texts, "tiny", num_draft_tokens=4)
    assert first.skip_layers == second.skip_layers and first.ranking == second.ranking
    assert first.prefix_acceptance == second.prefix_acceptance
    num_layers = loaded.config.num_layers
    assert 1 <= len(first.skip_layers) <= num_layers // 2
    assert sorted(first.ranking) == list(range(num_layers))
    # the choice is a prefix of the ranking, and its acceptance the one measured for it
    assert set(first.skip_layers) == set(first.ranking[:len(first.skip_layers)])
    assert first.acceptance == first.prefix_acceptance[len(first.skip_layers) - 1]
    assert first.num_tokens == sum(len(t) for t in texts) and 0 <= first.acceptance <= 1


def test_every_layer_kept_is_the_full_forward(tiny):
    loaded, texts = tiny
    from generation_service.model.layer_skip import _TeacherForced
    forward = _TeacherForced(loaded.model, texts[0])
    assert forward.num_matches(set()) == len(texts[0])
    assert torch.equal(forward.argmax(list(range(loaded.config.num_layers))), forward.full)


def test_the_choice_is_cached_per_model(tiny, tiny_random_path, tmp_path, monkeypatch):
    monkeypatch.setenv("STRUCTGEN_CACHE", str(tmp_path))
    loaded, texts = tiny
    key = model_key(str(tiny_random_path), "tiny-random")
    assert key == model_key(str(tiny_random_path), "another name")  # the files name the model
    assert key != model_key(None, "random:llama-3.1-8b") != model_key(None, "random:llama-3.1-8b", seed=1)
    assert load_choice(key) is None
    choice = calibrate(loaded.model, texts[:1], key, max_skip=1)
    assert store_choice(choice) == choice_path(key) and choice_path(key).parent == tmp_path / "self-spec"
    assert load_choice(key) == choice
    assert choice.draft_layers(loaded.config.num_layers) == tuple(
        i for i in range(loaded.config.num_layers) if i not in choice.skip_layers)


def test_the_cli_step_caches_what_an_engine_reads(tiny_random_path, tmp_path, monkeypatch, capsys):
    import json

    from structgen.cli import main
    monkeypatch.setenv("STRUCTGEN_CACHE", str(tmp_path))
    text = tmp_path / "text.txt"
    text.write_text("One two three.\n===\nFour five six seven eight nine ten.\n")
    assert main(["calibrate-self-spec", "--model", str(tiny_random_path), "--text-file", str(text),
                 "--max-tokens", "16"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    choice = load_choice(model_key(str(tiny_random_path), "any"))
    assert choice is not None and list(choice.skip_layers) == printed["skip_layers"]
    assert printed["path"] == str(choice_path(choice.model_key))
