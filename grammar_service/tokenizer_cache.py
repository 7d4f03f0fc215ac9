"""What grammar_service derives from a tokenizer.json, kept on disk by the files' content.

Loading a 131k tokenizer for the grammar backends re-derives the same things every time: the
fingerprint (a canonical pass over the JSON), the token strings by id, and xgrammar's
TokenizerInfo (vocabulary type detection, then its own pass over every token); on 2 busy CPUs
that is seconds (docs/grammar_service.md, "Start-up"). They depend only on the tokenizer files,
the logits width and the library versions, so they are stored under a digest of exactly those:

    <cache>/grammar-tokenizers/<digest>/vocab.json       fingerprint, token strings, stop and special ids
                                        /<backend>.bin   a backend's `tokenizer_codec` dump

written once and atomically (structgen/cache_dir.py); where the cache folder cannot be written,
in the temporary folder. An entry that does not load is removed and derived again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from structgen.cache_dir import cache_root, ensure_folder

log = logging.getLogger(__name__)

FORMAT = "1"  # bump when what is stored, or how it is derived, changes
_SOURCES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")  # what the fingerprint reads
_LIBRARIES = ("tokenizers", "xgrammar", "llguidance")


@dataclass(frozen=True)
class CachedTokenizer:
    fingerprint: str
    encoded_vocab: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    special_token_ids: tuple[int, ...]
    dumps: dict[str, bytes]  # backend name -> its tokenizer_codec dump


def digest(folder: pathlib.Path, vocab_size: int) -> str:
    """sha256 over the tokenizer files' bytes, the logits width, the libraries' versions and FORMAT."""
    sha = hashlib.sha256(f"{FORMAT}\0{vocab_size}\0".encode())
    for name in _LIBRARIES:
        try:
            sha.update(f"{name}={version(name)}\0".encode())
        except PackageNotFoundError:
            sha.update(f"{name}=-\0".encode())
    for name in _SOURCES:
        path = folder / name
        blob = path.read_bytes() if path.is_file() else b""
        sha.update(f"{name}\0{len(blob)}\0".encode())
        sha.update(blob)
    return sha.hexdigest()[:32]


def _roots() -> tuple[pathlib.Path, pathlib.Path]:
    fallback = pathlib.Path(tempfile.gettempdir()) / f"structgen-{os.getuid()}"
    return cache_root() / "grammar-tokenizers", fallback / "grammar-tokenizers"


def read(key: str) -> CachedTokenizer | None:
    """The entry stored under `key`, or None (absent, or unreadable: then removed)."""
    for root in _roots():
        folder = root / key
        if not (folder / "vocab.json").is_file():
            continue
        try:
            return _read(folder)
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("tokenizer cache entry %s does not load (%s); deriving it again", folder, error)
            shutil.rmtree(folder, ignore_errors=True)
    return None


def _read(folder: pathlib.Path) -> CachedTokenizer:
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    dumps = {path.stem: path.read_bytes() for path in folder.glob("*.bin")}
    return CachedTokenizer(vocab["fingerprint"], tuple(vocab["encoded_vocab"]), tuple(vocab["stop_token_ids"]),
                           tuple(vocab["special_token_ids"]), dumps)


def write(key: str, entry: CachedTokenizer) -> None:
    """Store `entry` under `key` (a full or read-only disk costs the next load time, nothing else)."""
    def fill(staging: pathlib.Path) -> None:
        for name, blob in entry.dumps.items():
            (staging / f"{name}.bin").write_bytes(blob)
        (staging / "vocab.json").write_text(json.dumps({  # last: its presence marks a whole entry
            "fingerprint": entry.fingerprint, "encoded_vocab": entry.encoded_vocab,
            "stop_token_ids": entry.stop_token_ids, "special_token_ids": entry.special_token_ids}), encoding="utf-8")

    for root in _roots():
        try:
            ensure_folder(root / key, "vocab.json", fill)
            return
        except OSError as error:
            log.warning("cannot write the tokenizer cache under %s: %s", root, error)
