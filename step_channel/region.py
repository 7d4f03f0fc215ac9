"""The shared-memory region: create (generation_service), attach (grammar_service), views.

Both sides map the same POSIX shared-memory file. Views are numpy arrays over the mapping,
so writes are plain stores that the other process (or the GPU, through the device mapping
registered in `step_channel.cuda`) sees directly. Ordering: every writer fills its part of
the entry first and then publishes the sequence number; x86-64 keeps stores in order and
readers load the sequence number before the data (acquire by program order on TSO).
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
import struct
import time
from dataclasses import dataclass

import numpy as np

from step_channel.layout import (
    HEADER_BYTES, HEARTBEAT_OFFSET, MAGIC, PIDS_OFFSET, SEQ_OFFSETS, VERSION, DESC_ROW_WORDS,
    RESULT_WORDS, EntryLayout, Geometry, entry_offset, region_bytes, seq_reached,
)

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
_HEADER = struct.Struct("<8I2Q")  # magic, version, max_batch, max_positions, mask_words, depth, vocab, reserved, entry_bytes, entries_off


class ChannelError(RuntimeError):
    """The region is missing, not a step channel, or its geometry does not match."""


@dataclass
class StepEntry:
    """Numpy views of one ring entry; each part has exactly one writer (see layout)."""

    desc_header: np.ndarray      # (2,) step, batch_size
    forward_us: np.ndarray       # (1,) the engine's recent forward time; 0: no row may be late
    desc_rows: np.ndarray        # (max_batch, 4) slot, num_positions, flags, grammar_id
    drafts: np.ndarray           # (max_batch, max(max_drafts, 1))
    out_counts: np.ndarray       # (max_batch,)
    out_tokens: np.ndarray       # (max_batch, max_positions)
    mask_status: np.ndarray      # (1,)
    valid_positions: np.ndarray  # (max_batch,) positions of this step's rows the grammar allows
    results: np.ndarray          # (max_batch, 2) terminated_at, error -- for step N-1's rows
    forced_counts: np.ndarray    # (max_batch,) length of each row's forced run (0: none)
    forced_tokens: np.ndarray    # (max_batch, max_positions) the run, from position valid - 1
    masks: np.ndarray            # (max_rows, mask_words) int32

    @property
    def step(self) -> int:
        return int(self.desc_header[0])

    @property
    def batch_size(self) -> int:
        return int(self.desc_header[1])


class StepChannel:
    """One mapped step-channel region. Use `create` or `attach`; close when done."""

    def __init__(self, name: str, geometry: Geometry, mm: mmap.mmap, *, owner: bool):
        self.name = name
        self.geometry = geometry
        self._mm = mm
        self._owner = owner
        self.buffer = np.frombuffer(mm, dtype=np.uint8)
        self._seq = {k: self.buffer[o:o + 4].view(np.uint32) for k, o in SEQ_OFFSETS.items()}
        self._heartbeat = self.buffer[HEARTBEAT_OFFSET:HEARTBEAT_OFFSET + 8].view(np.uint64)
        self._pids = self.buffer[PIDS_OFFSET:PIDS_OFFSET + 8].view(np.uint32)
        self._entries = [self._make_entry(k) for k in range(geometry.depth)]

    # ---- lifecycle -------------------------------------------------------------------
    @classmethod
    def create(cls, geometry: Geometry, name: str | None = None) -> "StepChannel":
        """Create a fresh region (mode 0600, random name); the creator unlinks it on close."""
        name = name or f"structgen-{secrets.token_hex(8)}"
        path = os.path.join(SHM_DIR, name)
        size = region_bytes(geometry)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        layout = EntryLayout.for_geometry(geometry)
        _HEADER.pack_into(mm, 0, MAGIC, VERSION, geometry.max_batch, geometry.max_positions,
                          geometry.mask_words, geometry.depth, geometry.vocab_size, 0,
                          layout.size, HEADER_BYTES)
        chan = cls(name, geometry, mm, owner=True)
        chan._pids[0] = os.getpid()
        log.info("created step channel %s (%d bytes, %s)", path, size, geometry)
        return chan

    @classmethod
    def attach(cls, name: str, expected: Geometry | None = None) -> "StepChannel":
        """Map an existing region; refuse a wrong magic, version or geometry with what differs."""
        if "/" in name:
            raise ChannelError(f"channel name must be a bare /dev/shm name, got {name!r}")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ChannelError(f"step channel {path} does not exist") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ChannelError(f"{path} is {size} bytes, smaller than a step-channel header")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, mb, mp, mw, depth, vocab, _, _, _ = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC:
            raise ChannelError(f"{path} is not a step channel (magic {magic:#x})")
        if version != VERSION:
            raise ChannelError(f"step channel version {version} != supported version {VERSION}")
        found = Geometry(max_batch=mb, max_positions=mp, vocab_size=vocab, depth=depth)
        if expected is not None and found != expected:
            diffs = [f"{f}: region has {getattr(found, f)}, expected {getattr(expected, f)}"
                     for f in ("max_batch", "max_positions", "vocab_size", "depth")
                     if getattr(found, f) != getattr(expected, f)]
            raise ChannelError("step channel geometry mismatch: " + "; ".join(diffs))
        if size != region_bytes(found) or mw != found.mask_words:
            raise ChannelError(f"{path} has {size} bytes, geometry {found} needs {region_bytes(found)}")
        chan = cls(name, found, mm, owner=False)
        chan._pids[1] = os.getpid()
        return chan

    def close(self) -> None:
        self._entries = []
        self._seq = {}
        self.buffer = None  # drop numpy views before closing the mapping
        try:
            self._mm.close()
        except BufferError:
            log.debug("step channel %s still has live views; left mapped", self.name)
        if self._owner:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass

    def __enter__(self) -> "StepChannel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- entries -------------------------------------------------------------------------
    def _make_entry(self, k: int) -> StepEntry:
        g = self.geometry
        lay = EntryLayout.for_geometry(g)
        base = entry_offset(g, k)

        def view(off: int, shape: tuple[int, ...]) -> np.ndarray:
            n = int(np.prod(shape))
            return self.buffer[base + off: base + off + 4 * n].view(np.int32).reshape(shape)

        return StepEntry(
            desc_header=view(lay.desc_header, (2,)),
            forward_us=view(lay.desc_header + 8, (1,)),
            desc_rows=view(lay.desc_rows, (g.max_batch, DESC_ROW_WORDS)),
            drafts=view(lay.drafts, (g.max_batch, max(g.max_drafts, 1))),
            out_counts=view(lay.out_counts, (g.max_batch,)),
            out_tokens=view(lay.out_tokens, (g.max_batch, g.max_positions)),
            mask_status=view(lay.mask_status, (1,)),
            valid_positions=view(lay.valid_positions, (g.max_batch,)),
            results=view(lay.results, (g.max_batch, RESULT_WORDS)),
            forced_counts=view(lay.forced_counts, (g.max_batch,)),
            forced_tokens=view(lay.forced_tokens, (g.max_batch, g.max_positions)),
            masks=view(lay.masks, (g.max_rows, g.mask_words)),
        )

    def entry(self, step: int) -> StepEntry:
        return self._entries[step % self.geometry.depth]

    def seq_offset(self, which: str) -> int:
        """Byte offset of a sequence word (for the device-side wait/write)."""
        return SEQ_OFFSETS[which]

    # ---- sequence numbers ----------------------------------------------------------------
    def load_seq(self, which: str) -> int:
        return int(self._seq[which][0])

    def publish_seq(self, which: str, value: int) -> None:
        """Store a sequence number; the caller has written the data it covers before this."""
        self._seq[which][0] = value & 0xFFFFFFFF

    def wait_seq(self, which: str, target: int, timeout_s: float | None = None,
                 spin_s: float = 50e-6, max_sleep_s: float = 1e-3) -> bool:
        """Wait until seq >= target (wrap-safe): spin for spin_s, then back off in sleeps from
        10 us up to max_sleep_s. The spin yields the CPU each round (and the GIL: the process's
        other Python threads run meanwhile). False on timeout."""
        word = self._seq[which]
        target &= 0xFFFFFFFF
        start = time.perf_counter()
        deadline = None if timeout_s is None else start + timeout_s
        sleep = 10e-6
        while not seq_reached(int(word[0]), target):
            now = time.perf_counter()
            if deadline is not None and now >= deadline:
                return False
            if now - start > spin_s:
                time.sleep(sleep)
                sleep = min(sleep * 2, max_sleep_s)
            else:
                os.sched_yield()
        return True

    # ---- liveness --------------------------------------------------------------------------
    def beat(self) -> None:
        """grammar_service: record that its loop is alive."""
        self._heartbeat[0] = time.monotonic_ns()

    def heartbeat_age_s(self) -> float:
        last = int(self._heartbeat[0])
        return float("inf") if last == 0 else (time.monotonic_ns() - last) / 1e9

    @property
    def creator_pid(self) -> int:
        return int(self._pids[0])

    @property
    def attached_pid(self) -> int:
        return int(self._pids[1])
