"""Load the served model's tokenizer.json into what grammar backends need (no transformers)."""
from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer

from grammar_service.backends.base import TokenizerData
from structgen.tokenizer_identity import fingerprint_tokenizer_json


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
    tok = Tokenizer.from_file(str(path))
    vocab = tok.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, token_id in vocab.items():
        if token_id < vocab_size:
            encoded[token_id] = token
    special = sorted(i for i, token in tok.get_added_tokens_decoder().items() if token.special and i < vocab_size)
    data = TokenizerData(encoded_vocab=tuple(encoded), vocab_size=vocab_size,
                         stop_token_ids=tuple(_eos_ids(path.parent, vocab)),
                         tokenizer_json=path.read_text(encoding="utf-8"),  # as is: to_str() re-serializes it
                         special_token_ids=tuple(special), text_tokenizer=tok)
    return data, fingerprint_tokenizer_json(path, vocab_size)

