"""Tokenizer identity shared by both processes (no torch here: grammar_service imports it).

generation_service and grammar_service must agree on the token vocabulary before a mask
built by one is applied to the logits of the other. Both compute
``fingerprint_tokenizer_json`` over the same tokenizer files and compare the strings when
the step channel is opened.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib


def _tokenizer_json_path(tokenizer_dir_or_file: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(tokenizer_dir_or_file)
    return path / "tokenizer.json" if path.is_dir() else path


def _canonical_vocab(tokenizer_json: dict) -> dict[str, int]:
    """token -> id over the model vocabulary and the added tokens."""
    model = tokenizer_json.get("model") or {}
    vocab = model.get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], id = index
        token_to_id = {entry[0]: index for index, entry in enumerate(vocab)}
    else:  # BPE, WordPiece, WordLevel: {token: id}
        token_to_id = dict(vocab)
    for added in tokenizer_json.get("added_tokens") or []:
        token_to_id[added["content"]] = added["id"]
    return token_to_id


def _special_ids(tokenizer_json: dict, token_to_id: dict[str, int], folder: pathlib.Path) -> dict:
    special = sorted(t["id"] for t in tokenizer_json.get("added_tokens") or [] if t.get("special"))
    eos: set[int] = set()
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        token = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and token in token_to_id:
            eos.add(token_to_id[token])
    generation_path = folder / "generation_config.json"
    if generation_path.is_file():
        ids = json.loads(generation_path.read_text(encoding="utf-8")).get("eos_token_id")
        eos.update([ids] if isinstance(ids, int) else list(ids or []))
    return {"special": special, "eos": sorted(eos)}


def fingerprint_tokenizer_json(tokenizer_dir_or_file: str | os.PathLike, vocab_size: int) -> str:
    """sha256 (hex) identifying a tokenizer as the grammar masks see it.

    Covers the canonical vocabulary (token -> id, added tokens included), the special and
    EOS ids (tokenizer_config.json / generation_config.json beside tokenizer.json), the
    decoder (it decides which bytes a token stands for) and ``vocab_size``, the logits width
    the masks are built for. Formatting of the JSON files does not matter.
    """
    path = _tokenizer_json_path(tokenizer_dir_or_file)
    tokenizer_json = json.loads(path.read_text(encoding="utf-8"))
    token_to_id = _canonical_vocab(tokenizer_json)
    canonical = {
        "vocab": sorted((token_id, token) for token, token_id in token_to_id.items()),
        "ids": _special_ids(tokenizer_json, token_to_id, path.parent),
        "decoder": tokenizer_json.get("decoder"),
        "vocab_size": int(vocab_size),
    }
    blob = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
