"""Load the served model's tokenizer.json into what grammar backends need (no transformers).

Three levels, fastest first: the tokenizer this process (or the process it was forked from)
loaded last; the on-disk cache of what is derived from the files (tokenizer_cache.py); the
files themselves, whose derivation is then cached.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import threading
from concurrent.futures import ThreadPoolExecutor

from tokenizers import Tokenizer

from grammar_service import tokenizer_cache
from grammar_service.backends import available_backends, load_backend_class
from grammar_service.backends.base import TokenizerData
from grammar_service.tokenizer_cache import CachedTokenizer
from structgen.tokenizer_identity import fingerprint_tokenizer_json

log = logging.getLogger(__name__)
_last: dict[tuple, tuple[TokenizerData, str]] = {}  # at most one entry: (path, files' stat) -> loaded
_lock = threading.Lock()


def _eos_ids(folder: pathlib.Path, vocab: dict[str, int]) -> list[int]:
    """EOS ids from tokenizer_config.json and generation_config.json, as the fingerprint reads them."""
    ids: list[int] = []
    config = folder / "tokenizer_config.json"
    if config.is_file():
        token = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and token in vocab:
            ids.append(vocab[token])
    generation = folder / "generation_config.json"
    if generation.is_file():
        found = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
        ids.extend([found] if isinstance(found, int) else list(found or []))
    return sorted(set(ids))


def load_tokenizer(tokenizer_dir: str, vocab_size: int) -> tuple[TokenizerData, str]:
    """(TokenizerData, fingerprint) for the tokenizer.json in `tokenizer_dir`.

    `vocab_size` is the mask width (the model's logits width); tokens with ids at or
    above it are dropped, ids the tokenizer lacks stay empty strings (never allowed).
    Raises FileNotFoundError / ValueError with the path when the folder is unusable.
    """
    folder = pathlib.Path(tokenizer_dir)
    path = folder / "tokenizer.json" if folder.is_dir() else folder
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    stat = tuple((os.stat(p).st_mtime_ns, os.stat(p).st_size) if p.is_file() else None
                 for p in (path, path.parent / "tokenizer_config.json", path.parent / "generation_config.json"))
    memo_key = (str(path.resolve()), vocab_size, stat)
    with _lock:
        if memo_key in _last:
            return _last[memo_key]
    text = path.read_text(encoding="utf-8")  # as is: to_str() re-serializes it
    key = tokenizer_cache.digest(path.parent, vocab_size)
    cached = tokenizer_cache.read(key)
    if cached is None:
        data, fingerprint = _derive(path, text, vocab_size)
        tokenizer_cache.write(key, _to_cache(data, fingerprint))
    else:
        data, fingerprint = _from_cache(cached, text, vocab_size)
    with _lock:
        _last.clear()
        _last[memo_key] = (data, fingerprint)
    return data, fingerprint


def _derive(path: pathlib.Path, text: str, vocab_size: int) -> tuple[TokenizerData, str]:
    tok = Tokenizer.from_str(text)
    vocab = tok.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, token_id in vocab.items():
        if token_id < vocab_size:
            encoded[token_id] = token
    special = sorted(i for i, token in tok.get_added_tokens_decoder().items() if token.special and i < vocab_size)
    data = TokenizerData(encoded_vocab=tuple(encoded), vocab_size=vocab_size,
                         stop_token_ids=tuple(_eos_ids(path.parent, vocab)), tokenizer_json=text,
                         special_token_ids=tuple(special), derived={"text": tok})
    return data, fingerprint_tokenizer_json(path, vocab_size)


def _to_cache(data: TokenizerData, fingerprint: str) -> CachedTokenizer:
    dumps = {}
    for name, cls in _backend_classes():
        codec = cls.tokenizer_codec()
        if codec is not None:
            dumps[name] = codec[0](data.derive(name, lambda: cls.derive_tokenizer(data)))
    return CachedTokenizer(fingerprint, data.encoded_vocab, data.stop_token_ids, data.special_token_ids, dumps)


def _from_cache(cached: CachedTokenizer, text: str, vocab_size: int) -> tuple[TokenizerData, str]:
    data = TokenizerData(encoded_vocab=cached.encoded_vocab, vocab_size=vocab_size,
                         stop_token_ids=cached.stop_token_ids, tokenizer_json=text,
                         special_token_ids=cached.special_token_ids)
    for name, cls in _backend_classes():
        codec = cls.tokenizer_codec()
        if codec is not None and name in cached.dumps:
            data.derived[name] = codec[1](cached.dumps[name])
    return data, cached.fingerprint


def derive_all(data: TokenizerData) -> None:
    """Make everything every user of `data` derives from it (the text tokenizer, each installed
    backend's tokenizer data) now, e.g. before forking processes that will use it. The parts
    are made side by side (each releases the GIL much of its time); their threads have ended
    when this returns."""
    makers = [lambda: data.text_tokenizer]
    makers += [lambda cls=cls, name=name: data.derive(name, lambda: cls.derive_tokenizer(data))
               for name, cls in _backend_classes()]
    with ThreadPoolExecutor(len(makers), thread_name_prefix="derive") as pool:
        for made in [pool.submit(make) for make in makers]:
            made.result()


def _backend_classes():
    for name in available_backends():
        try:
            yield name, load_backend_class(name)
        except ValueError:  # not installed here
            pass
