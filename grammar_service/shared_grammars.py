"""The grammars requests reuse, recorded for the grammar_service processes beside this one.

`structgen serve`'s supervisor gives all its grammar children one folder
(`--shared-grammars-dir`). A child records there every grammar that requests use again (at its
first cache hit): its spec, in a file named by its cache key. Every child compiles, one at a
time in the background, the recorded grammars it does not hold yet, newest first
(`SharedGrammars.mirror`) and only while it serves no step channel, so the standby that takes
over after a crash already holds the grammars in use and the requests after the crash find them
compiled, while the serving process spends no CPU on it.

The spec is shared, not the compiled grammar: xgrammar's serialized form loads several times
slower than it compiles and llguidance has none (docs/grammar_service.md, "Start-up").
Safe where it is used: one private folder (0700) per serve; entries carry the tokenizer's
fingerprint and a process with another tokenizer skips them; a recorded grammar goes through
the compile workers again like any new grammar. Bounded: MAX_RECORDS files, the oldest removed.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import tempfile
import threading
from concurrent.futures import Future
from typing import Callable

from grammar_contract.spec import GrammarSpec, ReasoningSpan

log = logging.getLogger(__name__)

MAX_RECORDS = 256
MIRROR_INTERVAL_S = 0.5  # between looks at the folder
_BUSY = ("RESOURCE_EXHAUSTED", "UNAVAILABLE")  # a compile refused for capacity or shutdown


def _spec_json(spec: GrammarSpec) -> dict:
    return dataclasses.asdict(spec)


def _spec_from(raw: dict) -> GrammarSpec:
    reasoning = raw.get("reasoning")
    return GrammarSpec(**{**raw, "choices": tuple(raw["choices"]),
                          "reasoning": ReasoningSpan(**reasoning) if reasoning else None})


class SharedGrammars:
    """One tokenizer's view of the folder; `record` is thread-safe."""

    def __init__(self, folder: str | os.PathLike, fingerprint: str):
        self.folder = pathlib.Path(folder)
        self.fingerprint = fingerprint
        self._recorded: set[str] = set()  # keys this process wrote or found already there
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def record(self, key: str, spec: GrammarSpec) -> None:
        """Write `spec` under `key` once (a full disk costs the next takeover a compile, nothing else)."""
        with self._lock:
            if key in self._recorded:
                return
            self._recorded.add(key)
        try:
            self.folder.mkdir(mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.folder)  # mode 0600
            # strict is each caller's check, not part of the grammar (compiler.spec_key)
            entry = {"fingerprint": self.fingerprint, "spec": _spec_json(dataclasses.replace(spec, strict=False))}
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(entry, out)
            os.replace(tmp, self.folder / f"{key}.json")
            self._prune()
        except OSError as error:
            log.warning("cannot record grammar %s in %s: %s", key[:16], self.folder, error)

    def _prune(self) -> None:
        entries = sorted(self.folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
        for path in entries[:max(0, len(entries) - MAX_RECORDS)]:
            path.unlink(missing_ok=True)

    def recorded(self, skip: Callable[[str], bool]) -> list[tuple[str, GrammarSpec]]:
        """(key, spec) of the entries for this tokenizer whose key `skip` refuses, newest first."""
        found = []
        try:
            paths = sorted(self.folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        except OSError:  # no folder yet, or a file removed while sorting
            return []
        for path in paths:
            if skip(path.stem):
                continue
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))
                if raw["fingerprint"] == self.fingerprint:
                    found.append((path.stem, _spec_from(raw["spec"])))
            except (OSError, ValueError, KeyError, TypeError) as error:  # pruned meanwhile, or foreign
                log.debug("skipping recorded grammar %s: %s", path.name, error)
        return found

    def mirror(self, is_cached: Callable[[str], bool], compile: Callable[[GrammarSpec], Future],
               is_serving: Callable[[], bool]) -> None:
        """Until `stop()`: compile what the others recorded and this process does not hold, while
        `is_serving()` is false (a process with an open channel spends its CPUs on it)."""
        tried: set[str] = set()  # compiled here, or failed here: never retried
        while not self._stop.is_set():
            for key, spec in [] if is_serving() else self.recorded(lambda k: k in tried or is_cached(k)):
                if self._stop.is_set() or is_serving():
                    break
                tried.add(key)
                with self._lock:
                    self._recorded.add(key)  # there already: a cache hit here need not write it
                try:
                    compile(spec).result()
                except Exception as error:  # noqa: BLE001 -- it failed for its request too
                    if getattr(error, "status", "") in _BUSY:  # no room now: next round
                        tried.discard(key)
                        break
                    log.info("recorded grammar %s did not compile here: %s", key[:16], error)
            self._stop.wait(MIRROR_INTERVAL_S)

    def stop(self) -> None:
        self._stop.set()
