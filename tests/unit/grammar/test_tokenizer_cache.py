"""The tokenizer data grammar_service derives, kept on disk by the files' content
(grammar_service/tokenizer_cache.py): a load from the cache gives what a load from the files
gives, a changed file is a new entry, a damaged entry is derived again."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from channel_driver import allowed_tokens
from grammar_contract.spec import GrammarSpec
from grammar_service import tokenizer, tokenizer_cache
from grammar_service.backends.xgrammar import XGrammarBackend

VOCAB = 32768
SCHEMA = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                "required": ["a"]}))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder, and no tokenizer remembered by this process."""
    monkeypatch.setenv("STRUCTGEN_CACHE", str(tmp_path / "cache"))
    tokenizer._last.clear()
    yield tmp_path / "cache" / "grammar-tokenizers"
    tokenizer._last.clear()


def _load_fresh(folder):
    tokenizer._last.clear()  # as a new process would
    return tokenizer.load_tokenizer(str(folder), VOCAB)


def _first_masks(data) -> np.ndarray:
    backend = XGrammarBackend(data, num_compile_threads=1, num_fill_threads=1)
    matcher = backend.new_matcher(backend.compile(SCHEMA))
    masks = np.zeros((1, data.mask_words), np.int32)
    backend.batch_fill([matcher], masks, [0])
    return masks[0]


def test_a_load_from_the_cache_gives_what_the_files_give(cache, mistral_32k_dir):
    derived, fingerprint = _load_fresh(mistral_32k_dir)
    (entry,) = cache.iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["vocab.json", "xgrammar.bin"]
    cached, cached_fingerprint = _load_fresh(mistral_32k_dir)
    assert "xgrammar" in cached.derived and "text" not in cached.derived  # loaded, not derived
    assert cached_fingerprint == fingerprint
    assert (cached.encoded_vocab, cached.stop_token_ids, cached.special_token_ids) == \
        (derived.encoded_vocab, derived.stop_token_ids, derived.special_token_ids)
    assert np.array_equal(_first_masks(cached), _first_masks(derived))
    assert len(allowed_tokens(_first_masks(cached))) > 0
    assert cached.text_tokenizer.encode("{").ids == derived.text_tokenizer.encode("{").ids


def test_a_changed_file_or_width_is_another_entry(cache, mistral_32k_dir, tmp_path):
    copy = tmp_path / "tok"
    shutil.copytree(mistral_32k_dir, copy)
    _, before = _load_fresh(copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<s>"}))
    data, after = _load_fresh(copy)
    assert after != before and data.stop_token_ids == (1,)
    assert tokenizer_cache.digest(copy, VOCAB) != tokenizer_cache.digest(copy, VOCAB + 64)
    assert len(list(cache.iterdir())) == 2


def test_a_damaged_entry_is_derived_again(cache, mistral_32k_dir):
    _, fingerprint = _load_fresh(mistral_32k_dir)
    (entry,) = cache.iterdir()
    (entry / "vocab.json").write_text('{"fingerprint": ')  # cut short
    data, again = _load_fresh(mistral_32k_dir)
    assert again == fingerprint and data.stop_token_ids == (2,)
    assert json.loads((entry / "vocab.json").read_text())["fingerprint"] == fingerprint  # rewritten


def test_an_unwritable_cache_costs_nothing_but_time(cache, mistral_32k_dir, monkeypatch, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("STRUCTGEN_CACHE", str(blocked))
    monkeypatch.setattr(tokenizer_cache.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    data, fingerprint = _load_fresh(mistral_32k_dir)
    assert data.stop_token_ids == (2,) and fingerprint
    assert list((tmp_path / "tmp").glob("structgen-*/grammar-tokenizers/*/vocab.json"))  # the fallback
