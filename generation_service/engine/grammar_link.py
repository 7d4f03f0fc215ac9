"""GrammarLink: the engine's side of the step channel (docs/step_channel.md).

Per grammar step N (an engine step with constrained or release rows; other steps never touch
the channel): `begin` writes descriptor N and the drafts, then `inputs_seq = N`, *before* the
forward, so the grammar service fills masks while the model runs; `wait` waits for
`mask_seq >= N` under the watchdog and returns the mask rows and the results of step N-1;
`publish` writes the accepted tokens and `outputs_seq = N`.

Late rows: a host step's descriptor carries `forward_us`, the engine's recent forward time
(grammar_service's measure of a slow row), and `forward_done` publishes `forward_seq = N` when
the forward of step N is done: a slow row whose mask is not ready then is VALID_LATE, the others'
masks are published at once, and the engine samples nothing for that row in that step
(lifecycle.py). GPU steps give 0: every row waits, because the graph would feed a late row's
sample back and publish it as accepted (left for the graph path: its epilogue would have to
read valid_positions).

GPU steps (runner "cuda_graph", docs/gpu.md) and mixed steps in stream order
(stream_channel.py): `begin(rows, gpu=True)` writes the descriptor only; the step itself
publishes `inputs_seq`, waits for `mask_seq` where it runs, and writes the outputs and
`outputs_seq`. `wait_gpu` keeps the watchdog on `mask_seq` while the
GPU waits and returns the step's tokens from the outputs area once `outputs_seq = N`.
Under overlap step N+1 is begun (and replayed) before `wait_gpu(N)`: two GPU steps may be
open at once, and the descriptor rows of N-1, N and N+1 are kept.

Watchdog: while waiting, a grammar_service whose process is gone, or which is past the
deadline with a stale heartbeat or not serving, is declared lost: the engine writes
`mask_status = MASK_RELEASED_BY_WATCHDOG` and `mask_seq = N` itself, the link disconnects
(its matchers are gone; GPU steps begun after N are released the same way first) and `reconnect` later opens a fresh region with the next step
number as `first_step` once grammar_service is serving again.
"""
from __future__ import annotations

import atexit
import bisect
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
import torch

from generation_service.engine.config import WAIT_BUCKETS_S
from generation_service.engine.request import Request
from grammar_contract.spec import GrammarSpec
from step_channel import (
    ERR_MASK, FLAG_CONSTRAINED, FLAG_FORCED_DRAFTS, FLAG_FRESH, FLAG_RELEASE, MASK_OK, MASK_RELEASED_BY_WATCHDOG,
    NOTE_BUDGET_CLOSED, Geometry, StepChannel,
)

log = logging.getLogger(__name__)
# The host's poll of a GPU step's sequence words: under overlap the next step is already
# queued, and the host must be back with the one after it before that ends (a 1B-shape step
# is ~1 ms, docs/gpu.md), so it sleeps in short steps rather than backing off to 1 ms.
GPU_POLL_SPIN_S = 100e-6
GPU_POLL_SLEEP_S = 50e-6
# `forward_us` is the median of the latest host forwards: a mean would keep a first forward that
# compiled kernels (seconds) for dozens of steps, and no fill would be slow beside it.
FORWARD_WINDOW = 9


class GrammarControl(Protocol):
    """The control client of grammar_service (grammar_contract/client.py), duck-typed here
    so that engine/ never imports grpc."""

    def open_channel(self, name: str, geometry: Geometry, *, max_slots: int, first_step: int,
                     tokenizer_dir: str, tokenizer_fingerprint: str) -> Any: ...
    def close_channel(self, name: str) -> Any: ...
    def compile(self, spec: GrammarSpec, trace_context: dict | None = None) -> Future: ...
    def is_serving(self) -> bool: ...
    def stats(self) -> dict: ...
    def close(self) -> None: ...


@dataclass
class LinkRow:
    """One descriptor row: a sampling row (constrained or free) or a release-only row."""

    request: Request | None     # None for release-only rows
    slot: int
    num_positions: int
    flags: int
    grammar_id: int = 0
    drafts: list[int] = field(default_factory=list)

    @property
    def is_constrained(self) -> bool:
        return bool(self.flags & FLAG_CONSTRAINED)

    @classmethod
    def sampling(cls, request: Request, drafts: list[int]) -> "LinkRow":
        if not request.is_constrained:
            return cls(request, -1, 1 + len(drafts), 0, 0, drafts)
        flags = FLAG_CONSTRAINED | (0 if request.is_matcher_bound else FLAG_FRESH)
        if request.wants_forced_drafts:
            flags |= FLAG_FORCED_DRAFTS
        return cls(request, request.slot, 1 + len(drafts), flags, request.grammar_id, drafts)

    @classmethod
    def release(cls, slot: int) -> "LinkRow":
        return cls(None, slot, 0, FLAG_RELEASE)


@dataclass
class RowResult:
    """grammar_service's verdict on the tokens a request's row accepted in the previous step."""

    request: Request
    terminated_at: int
    error: int
    budget_closed: bool = False  # its masks were narrowed to close within max_tokens (NOTE_BUDGET_CLOSED)


@dataclass
class StepMasks:
    bitmask: torch.Tensor | None  # (sum of num_positions of sampling rows, mask_words) int32; None: applied on the GPU
    results: list[RowResult]   # errors/termination for rows of the previous grammar step
    valid_positions: dict[int, int]  # id(request) -> leading positions with exact masks (0: none,
                                     # VALID_LATE: not ready, the row skips this step)
    # id(request) -> the run its grammar forces from position valid - 1 (FLAG_FORCED_DRAFTS rows)
    forced: dict[int, list[int]] = field(default_factory=dict)


class GrammarLink:
    def __init__(self, control: GrammarControl, geometry: Geometry, *, max_slots: int,
                 tokenizer_dir: str, tokenizer_fingerprint: str, wait_timeout_s: float,
                 reconnect_interval_s: float = 0.1) -> None:
        """`reconnect_interval_s`: between health checks while disconnected (one Check on a local
        socket each; a standby grammar_service takes over within a tenth of a second)."""
        self.control = control
        self.geometry = geometry
        self.max_slots = max_slots
        self.tokenizer_dir = tokenizer_dir
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.wait_timeout_s = wait_timeout_s
        self.reconnect_interval_s = reconnect_interval_s
        self.channel: StepChannel | None = None
        self.next_step = 1
        self._rows: dict[int, list[LinkRow]] = {}   # step -> its descriptor rows (N-1 and N)
        self._first_step = 1
        self._stale_names: list[str] = []
        self._prober: threading.Thread | None = None
        self._ready: tuple[StepChannel, int] | None = None  # opened by the prober, not yet installed
        self._is_closed = False
        self._open_step: int | None = None  # a host step begun, outputs not yet published
        self._released_tokens: dict[int, list[int]] = {}  # GPU steps the watchdog released early
        self.num_steps = 0
        self.wait_s_total = 0.0
        self.wait_counts = [0] * (len(WAIT_BUCKETS_S) + 1)  # steps by wait, WAIT_BUCKETS_S then above
        self._forwards: deque[float] = deque(maxlen=FORWARD_WINDOW)  # host steps' (forward_done)
        self.num_disconnects = 0
        self.disconnected_at = time.monotonic()  # of the last disconnect (or the start), while not connected
        # Called with a region before it is unmapped (the GPU runner unregisters it first).
        self.before_close: Callable[[StepChannel], None] | None = None

    @property
    def is_connected(self) -> bool:
        return self.channel is not None

    # ---- connection --------------------------------------------------------------------------
    def connect(self) -> bool:
        """Create a region and open it with grammar_service (blocking); False if that fails."""
        channel = self._open(self.next_step)
        if channel is not None:
            self._install(channel, self.next_step)
        return channel is not None

    def maybe_reconnect(self) -> bool:
        """Install a channel the prober opened; never blocks on a dead or stuck service (the
        engine loop calls this, under its lock, every step while disconnected)."""
        if self.is_connected:
            return True
        ready, self._ready = self._ready, None
        if ready is not None:
            self._install(*ready)
            return True
        if self._prober is None or not self._prober.is_alive():
            self._prober = threading.Thread(target=self._probe, name="grammar-probe", daemon=True)
            self._prober.start()
        return False

    def _probe(self) -> None:
        # NOTE: every RPC of a reconnect runs here, off the loop thread: is_serving() can take
        # its whole timeout on a stuck service, open_channel waits for the service to be ready.
        # next_step does not move while disconnected, so the opened channel starts where the
        # loop will continue.
        while not self._is_closed and not self.is_connected:
            if self._is_serving():
                first_step = self.next_step
                channel = self._open(first_step)
                if channel is not None:
                    self._close_stale()
                    self._ready = (channel, first_step)
                    return
            time.sleep(self.reconnect_interval_s)

    def _open(self, first_step: int) -> StepChannel | None:
        channel = StepChannel.create(self.geometry)
        atexit.register(_unlink_region, channel.name)  # even if the engine is never stopped
        try:
            self.control.open_channel(channel.name, self.geometry, max_slots=self.max_slots,
                                      first_step=first_step, tokenizer_dir=self.tokenizer_dir,
                                      tokenizer_fingerprint=self.tokenizer_fingerprint)
        except Exception as error:  # noqa: BLE001 -- any failure means "not connected yet"
            log.warning("grammar_service did not open step channel %s: %s", channel.name, error)
            channel.close()
            return None
        return channel

    def _install(self, channel: StepChannel, first_step: int) -> None:
        self.channel, self._first_step, self._rows = channel, first_step, {}
        log.info("step channel %s open from step %d", channel.name, first_step)

    def disconnect(self) -> None:
        """Drop the region; its matchers are gone. grammar_service is told when it is back."""
        if self.channel is None:
            return
        self._stale_names.append(self.channel.name)
        if self.before_close is not None:
            self.before_close(self.channel)
        self.channel.close()
        self.channel = None
        self.num_disconnects += 1
        self.disconnected_at = time.monotonic()

    def close(self) -> None:
        self._is_closed = True
        ready, self._ready = self._ready, None
        if ready is not None:  # opened by the prober, never installed
            self.channel = ready[0]
        if self.channel is not None:
            name = self.channel.name
            self.disconnect()
            self._stale_names.remove(name)
            try:
                self.control.close_channel(name)
            except Exception as error:  # noqa: BLE001
                log.debug("close_channel(%s): %s", name, error)

    def _close_stale(self) -> None:
        # A grammar_service that was stuck (not dead) still holds the old channel's matchers.
        for name in self._stale_names:
            try:
                self.control.close_channel(name)
            except Exception:  # noqa: BLE001 -- a restarted service never knew it
                pass
        self._stale_names = []

    # ---- one grammar step ----------------------------------------------------------------
    def begin(self, rows: list[LinkRow], gpu: bool = False) -> int:
        """Write descriptor + drafts of a new step, then inputs_seq; returns its number.
        gpu=True: descriptor and drafts only, the GPU step publishes inputs_seq itself."""
        step = self.next_step
        self.next_step += 1
        entry = self.channel.entry(step)
        if rows:  # one array write, not a numpy item assignment (a call each) per row
            entry.desc_rows[:len(rows)] = [(row.slot, row.num_positions, row.flags, row.grammar_id)
                                           for row in rows]
        for r, row in enumerate(rows):
            if row.drafts:
                entry.drafts[r, :len(row.drafts)] = row.drafts
        entry.desc_header[:] = (step, len(rows))
        entry.forward_us[0] = 0 if gpu else self.forward_us
        self._rows[step] = rows
        # N's results are read against N-1's rows; under overlap N+1 is begun before N is read.
        self._rows.pop(step - 3, None)
        # NOTE: inputs_seq = N also promises step N-1's outputs are written (publish did).
        if not gpu:
            self.channel.publish_seq("inputs_seq", step)
            self._open_step = step
        self.num_steps += 1
        return step

    @property
    def forward_s(self) -> float:
        """The recent host forward time: the lower median of the latest (0.0 until one was timed)."""
        recent = sorted(self._forwards)
        return recent[(len(recent) - 1) // 2] if recent else 0.0

    @property
    def forward_us(self) -> int:
        """`forward_s` in us (0 until a host step was timed: no row is late then)."""
        return max(1, int(self.forward_s * 1e6)) if self._forwards else 0

    def forward_done(self, step: int | None, seconds: float) -> None:
        """A host step's forward is done after `seconds`; from now on the engine waits for the
        masks of `step` (None: a step without the channel), so a mask not ready now is late."""
        self._forwards.append(seconds)
        if step is not None and self.channel is not None:
            self.channel.publish_seq("forward_seq", step)

    def wait(self, step: int) -> StepMasks | None:
        """Masks of `step` in sampling-row order, or None when the watchdog released it."""
        start = time.monotonic()
        released = not self._wait_masks(step, start)
        self._waited(time.monotonic() - start)
        entry = self.channel.entry(step)
        if released or int(entry.mask_status[0]) != MASK_OK:
            log.error("grammar_service lost at step %d; releasing the step", step)
            entry.mask_status[0] = MASK_RELEASED_BY_WATCHDOG
            self.channel.publish_seq("mask_seq", step)
            self.disconnect()
            return None
        rows = self._rows[step]
        index = [r * self.geometry.max_positions + p
                 for r, row in enumerate(rows) if row.request is not None
                 for p in range(row.num_positions)]
        bitmask = torch.from_numpy(np.array(entry.masks[index]))  # copy out of the ring
        valid = {id(row.request): int(entry.valid_positions[r])
                 for r, row in enumerate(rows) if row.request is not None}
        return StepMasks(bitmask, self._results(step, entry), valid, self._forced(rows, entry))

    def wait_gpu(self, step: int, num_rows: int, gpu_timeout_s: float = 60.0) -> tuple[StepMasks | None, list[int]]:
        """A GPU step: (results, tokens of rows [0, num_rows)) once the GPU wrote outputs_seq = N.

        The graph waits for mask_seq on the device; this thread watches the same word. A lost
        grammar_service is released as on the host path, except that the masks of the entry
        are first set to all ones so the free rows of the step sample unconstrained; the
        link then disconnects (the masks' results are None) after the GPU finished.
        """
        if step in self._released_tokens:  # released with an earlier step (overlap)
            return None, self._released_tokens.pop(step)[:num_rows]
        start = time.monotonic()
        released = not self._wait_masks(step, start, max_sleep_s=GPU_POLL_SLEEP_S)
        entry = self.channel.entry(step)
        if released:
            self._release_gpu_step(step)
        self._waited(time.monotonic() - start)
        if not self.channel.wait_seq("outputs_seq", step, timeout_s=gpu_timeout_s,
                                     spin_s=GPU_POLL_SPIN_S, max_sleep_s=GPU_POLL_SLEEP_S):
            raise RuntimeError(f"the GPU did not finish grammar step {step} in {gpu_timeout_s} s")
        tokens = entry.out_tokens[:num_rows, 0].tolist()
        if released or int(entry.mask_status[0]) != MASK_OK:
            # NOTE: steps launched after this one (overlap) wait on this region too: release
            # each in turn (the parity wait needs mask_seq = M exactly while M waits) before
            # the region is unregistered, keeping their tokens for their wait_gpu.
            for later in range(step + 1, self.next_step):
                self._release_gpu_step(later)
                if not self.channel.wait_seq("outputs_seq", later, timeout_s=gpu_timeout_s):
                    raise RuntimeError(f"the GPU did not finish grammar step {later} in {gpu_timeout_s} s")
                self._released_tokens[later] = self.channel.entry(later).out_tokens[:, 0].tolist()
            self.disconnect()
            return None, tokens
        rows = self._rows[step]
        valid = {id(row.request): int(entry.valid_positions[r])
                 for r, row in enumerate(rows) if row.request is not None}
        return StepMasks(None, self._results(step, entry), valid, self._forced(rows, entry)), tokens

    def wait_or_release(self, step: int) -> None:
        """A step in stream order on the host (stream_channel.py) waits here for its masks, under
        the watchdog; a lost grammar_service releases it as it releases a GPU's (all-ones masks),
        and `wait_gpu` reports that once the step is read."""
        start = time.monotonic()
        if not self._wait_masks(step, start):
            self._release_gpu_step(step)
        self._waited(time.monotonic() - start)

    def _waited(self, seconds: float) -> None:
        self.wait_s_total += seconds
        self.wait_counts[bisect.bisect_left(WAIT_BUCKETS_S, seconds)] += 1

    def _release_gpu_step(self, step: int) -> None:
        """The watchdog's release of a GPU step: all-ones masks (its free rows sample
        unconstrained), MASK_RELEASED_BY_WATCHDOG, mask_seq = step."""
        log.error("grammar_service lost at step %d; releasing the GPU", step)
        entry = self.channel.entry(step)
        entry.masks[:] = -1
        entry.mask_status[0] = MASK_RELEASED_BY_WATCHDOG
        self.channel.publish_seq("mask_seq", step)

    @staticmethod
    def _forced(rows: list[LinkRow], entry) -> dict[int, list[int]]:
        """The forced runs of the rows that asked for them; other rows' are never read."""
        out = {}
        for r, row in enumerate(rows):
            if row.flags & FLAG_FORCED_DRAFTS:
                out[id(row.request)] = entry.forced_tokens[r, :int(entry.forced_counts[r])].tolist()
        return out

    def _results(self, step: int, entry) -> list[RowResult]:
        if step == self._first_step or step - 1 not in self._rows:
            return []
        out = []
        for r, row in enumerate(self._rows[step - 1]):
            terminated_at, word = (int(x) for x in entry.results[r])
            if row.is_constrained and (word or terminated_at >= 0):
                out.append(RowResult(row.request, terminated_at, word & ERR_MASK, bool(word & NOTE_BUDGET_CLOSED)))
        return out

    def publish(self, step: int, outputs: list[list[int]]) -> None:
        """Accepted tokens per descriptor row (release rows: []), then outputs_seq = step."""
        self._open_step = None
        if self.channel is None:
            return
        entry = self.channel.entry(step)
        for r, tokens in enumerate(outputs):
            entry.out_tokens[r, :len(tokens)] = tokens
            entry.out_counts[r] = len(tokens)
        self.channel.publish_seq("outputs_seq", step)

    def abandon_open_step(self) -> None:
        """After a failed engine step: publish 'nothing accepted' for a step left open, so the
        next step's deferred advance never reads stale outputs from the ring."""
        step = self._open_step
        if step is not None and self.channel is not None:
            if self.channel.wait_seq("mask_seq", step, timeout_s=self.wait_timeout_s):
                self.publish(step, [[] for _ in self._rows.get(step, [])])
            else:
                self.disconnect()
        self._open_step = None

    # ---- watchdog ----------------------------------------------------------------------------
    def _wait_masks(self, step: int, start: float, max_sleep_s: float = 1e-3) -> bool:
        hard_deadline = start + 4 * self.wait_timeout_s
        while not self.channel.wait_seq("mask_seq", step, timeout_s=0.02, spin_s=GPU_POLL_SPIN_S,
                                        max_sleep_s=max_sleep_s):
            if not self._peer_alive():
                return False
            now = time.monotonic()
            if now - start < self.wait_timeout_s:
                continue
            if now > hard_deadline or self.channel.heartbeat_age_s() > self.wait_timeout_s:
                return False
            if not self._is_serving():
                return False
        return True

    def _is_serving(self) -> bool:
        try:
            return bool(self.control.is_serving())
        except Exception:  # noqa: BLE001
            return False

    def _peer_alive(self) -> bool:
        """False when grammar_service's process is known to be gone (a zombie counts as gone).
        Its pid may be from another pid namespace; then this stays True and the deadline rules."""
        pid = self.channel.attached_pid
        if pid <= 0:
            return True
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return not os.path.isdir("/proc/self")  # no /proc: cannot tell
        except (OSError, IndexError):
            return True
        return state not in (b"Z", b"X")


def _unlink_region(name: str) -> None:
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass
