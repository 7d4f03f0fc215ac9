"""Compiled grammars on disk, reloaded across restarts when that beats compiling.

A backend opts in with a codec (`serialize(compiled) -> str`, `deserialize(text)`); the
store keys files by (backend version, tokenizer fingerprint, grammar hash), writes only
grammars that were slow to compile and deletes any entry whose load turned out slower than
its compile.

xgrammar's JSON form of a CompiledGrammar spells out its per-rule token-mask cache, so it is
several times slower to load than to compile and slower still to write (measured:
docs/grammar_service.md, "Persisting compiled grammars"); llguidance compiles in
milliseconds and has no serialized form. Persisting therefore loses for both backends at
these versions, and `codec_for` offers no codec for them (XGRAMMAR_PERSIST_WORTHWHILE
records the decision; flip it when a release serializes compactly and
a measurement shows load < compile). The store and its policy stay, so
a backend with a compact format gets restarts for free.

Layout: `<root>/<backend>-<version>/<tokenizer fingerprint[:32]>/<grammar hash>.json`,
`{"compile_ms": ..., "grammar": <serialized>}`, written to a temporary file and renamed
(readers never see half a file), mode 0600; an unreadable file is deleted and compiled.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    compiled: Any
    from_disk: bool
    elapsed_ms: float   # load time when from_disk, else compile time


@dataclass
class StoreStats:
    num_loaded: int = 0
    num_saved: int = 0
    num_dropped: int = 0   # unreadable, or slower to load than to compile


class CompiledGrammarStore:
    """One backend x one tokenizer; thread-safe (files are written atomically)."""

    def __init__(self, root: str | os.PathLike, backend: str, backend_version: str,
                 tokenizer_fingerprint: str, *, min_compile_ms: float = 100.0):
        self.folder = pathlib.Path(root) / f"{backend}-{backend_version}" / tokenizer_fingerprint[:32]
        self.min_compile_ms = min_compile_ms
        self.stats = StoreStats()

    def path(self, grammar_hash: str) -> pathlib.Path:
        if not grammar_hash.isalnum():
            raise ValueError(f"grammar hash must be alphanumeric, got {grammar_hash!r}")
        return self.folder / f"{grammar_hash}.json"

    def load_or_compile(self, grammar_hash: str, compile: Callable[[], Any],
                        serialize: Callable[[Any], str], deserialize: Callable[[str], Any]) -> Loaded:
        """The grammar from disk if present and loadable, else compiled (and saved if slow)."""
        loaded = self._load(grammar_hash, deserialize)
        if loaded is not None:
            return loaded
        started = time.perf_counter()
        compiled = compile()
        compile_ms = (time.perf_counter() - started) * 1e3
        if compile_ms >= self.min_compile_ms:
            self._save(grammar_hash, serialize(compiled), compile_ms)
        return Loaded(compiled, False, compile_ms)

    def _load(self, grammar_hash: str, deserialize: Callable[[str], Any]) -> Loaded | None:
        path = self.path(grammar_hash)
        started = time.perf_counter()
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            compiled = deserialize(record["grammar"])
        except FileNotFoundError:
            return None
        except Exception as exc:  # truncated / foreign file: compile instead, drop the file
            log.warning("dropping unreadable compiled grammar %s: %s", path, exc)
            self._drop(path)
            return None
        load_ms = (time.perf_counter() - started) * 1e3
        if load_ms > float(record.get("compile_ms", 0.0)):
            self._drop(path)  # still use it this once; next time compiling is faster
        self.stats.num_loaded += 1
        return Loaded(compiled, True, load_ms)

    def _save(self, grammar_hash: str, blob: str, compile_ms: float) -> None:
        path = self.path(grammar_hash)
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.folder)  # mode 0600
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump({"compile_ms": round(compile_ms, 3), "grammar": blob}, out)
            os.replace(tmp, path)
            self.stats.num_saved += 1
        except OSError as exc:  # a full or read-only disk costs speed, never a request
            log.warning("cannot persist compiled grammar to %s: %s", path, exc)

    def _drop(self, path: pathlib.Path) -> None:
        self.stats.num_dropped += 1
        try:
            path.unlink()
        except OSError:
            pass


XGRAMMAR_PERSIST_WORTHWHILE = False  # see the table above


def codec_for(backend) -> tuple[Callable[[Any], str], Callable[[str], Any]] | None:
    """The (serialize, deserialize) pair to persist `backend`'s grammars, or None when
    loading would be slower than compiling."""
    if backend.name == "xgrammar" and XGRAMMAR_PERSIST_WORTHWHILE:
        return xgrammar_codec(backend.tokenizer_info)
    return None


def xgrammar_codec(tokenizer_info) -> tuple[Callable[[Any], str], Callable[[str], Any]]:
    """(serialize, deserialize) for xgrammar CompiledGrammar bound to the backend's TokenizerInfo."""
    import xgrammar as xgr

    return (lambda compiled: compiled.serialize_json(),
            lambda text: xgr.CompiledGrammar.deserialize_json(text, tokenizer_info))


def backend_version(backend: str) -> str:
    """Installed version of a backend's package, part of the store path."""
    from importlib.metadata import version

    return version({"xgrammar": "xgrammar", "llguidance": "llguidance"}.get(backend, backend))
