"""Byte layout of the step channel (docs/step_channel.md): a versioned header and a ring of step entries.

The region is one flat buffer shared by generation_service (creator; on CUDA hosts the GPU
reads and writes it through a device mapping) and grammar_service. Every field is a little-
endian 32-bit word or an array of them, so that `cuStreamWaitValue32` / `cuStreamWriteValue32`
can wait on and write the sequence numbers directly.

    header (HEADER_BYTES)
      0   magic, version, max_batch, max_positions, mask_words, depth, vocab_size, reserved
      32  entry_bytes (u64), entries_offset (u64)
      SEQ_OFFSETS: one 64-byte line per sequence word (no false sharing between writers)
    entry k = step N with N % depth == k, each part with one writer:
      descriptor    step, batch_size, forward_us, rows[max_batch] x (slot, num_positions,
                    flags, grammar_id) -- CPU scheduler, before launching step N
      drafts        [max_batch, max_drafts]            -- whoever proposes drafts
      outputs       counts[max_batch], tokens[max_batch, max_positions]  -- GPU / sampler
      grammar part  mask_status, valid_positions[max_batch] (this step's rows),
                    results[max_batch] x (terminated_at, error | notes) for step N-1's rows,
                    forced_counts[max_batch], forced_tokens[max_batch, max_positions]
                    (the run the grammar forces from each FLAG_FORCED_DRAFTS row's last
                    exact position),
                    masks[max_batch * max_positions, mask_words]         -- grammar_service

Mask row of (row r, position p) is r * max_positions + p. A set bit allows a token.
"""
from __future__ import annotations

from dataclasses import dataclass

MAGIC = 0x43534753  # "SGSC"
VERSION = 3  # 2: forward_us, forward_seq, VALID_LATE; 3: forced runs (FLAG_FORCED_DRAFTS)
HEADER_BYTES = 4096
LINE = 64
ALIGN = 128
MIN_DEPTH = 3  # step N+1 is described while N runs and N-1's outputs are still read

# Sequence words, each on its own cache line of the header.
SEQ_OFFSETS = {
    "inputs_seq": 128,   # GPU/engine: drafts of step N are in place, step N-1 outputs written
    "outputs_seq": 192,  # GPU/engine: outputs of step N written
    "mask_seq": 256,     # grammar_service (or the watchdog): masks of step N ready
    "forward_seq": 448,  # engine (host steps): the forward of step N is done, it waits for masks now
}
HEARTBEAT_OFFSET = 320   # u64 monotonic ns, written by grammar_service every loop turn
PIDS_OFFSET = 384        # u32 creator pid, u32 grammar_service pid

# Descriptor row flags.
FLAG_FRESH = 1 << 0      # bind a new matcher to the slot from grammar_id before filling
FLAG_RELEASE = 1 << 1    # drop the slot's matcher after this step (num_positions may be 0)
FLAG_CONSTRAINED = 1 << 2  # the slot has a matcher; unconstrained rows get all-ones masks
# Write the row's forced run: the tokens the grammar forces from position valid_positions - 1
# (the grammar proposer's drafts, engine/speculative.py); other rows' forced_counts are 0.
FLAG_FORCED_DRAFTS = 1 << 3

# Per-row result error codes (results of the previous step's accepted tokens).
ERR_NONE = 0
ERR_TOKEN_REJECTED = 1   # an accepted token was rejected by the matcher: abort the request
ERR_UNKNOWN_GRAMMAR = 2  # FRESH named a grammar id grammar_service does not hold
ERR_NO_MATCHER = 3       # a constrained row's slot has no bound matcher
ERR_INTERNAL = 4
ERR_MASK = 0xFF          # the error code's bits of the error word
# A note beside the error code (OR-ed in): this row's masks were narrowed to close its output
# within its max_tokens (grammar_service/budget/), reported once per request.
NOTE_BUDGET_CLOSED = 1 << 8

# Entry mask_status values.
MASK_OK = 0
MASK_RELEASED_BY_WATCHDOG = 1  # grammar_service was gone or stuck; masks are not valid

# valid_positions of a row whose mask was not ready when the engine's forward of the step was done
# (forward_seq, on steps whose forward_us is set): the engine does not sample it this step
# (nothing accepted, its position not advanced) and sends it again.
VALID_LATE = -1

DESC_ROW_WORDS = 4  # slot, num_positions, flags, grammar_id
RESULT_WORDS = 2    # terminated_at, error


def _align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Geometry:
    """Sizes both processes must agree on; checked when grammar_service attaches."""

    max_batch: int
    max_positions: int  # 1 + max draft tokens per row
    vocab_size: int     # logits width of the model (may exceed the tokenizer's vocabulary)
    depth: int = 4

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_positions < 1 or self.vocab_size < 1:
            raise ValueError(f"geometry sizes must be positive: {self}")
        if self.depth < MIN_DEPTH:
            raise ValueError(f"ring depth must be >= {MIN_DEPTH}, got {self.depth}")

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    @property
    def max_drafts(self) -> int:
        return self.max_positions - 1

    @property
    def max_rows(self) -> int:
        return self.max_batch * self.max_positions


@dataclass(frozen=True)
class EntryLayout:
    """Byte offsets of one ring entry's parts, relative to the entry start."""

    desc_header: int
    desc_rows: int
    drafts: int
    out_counts: int
    out_tokens: int
    mask_status: int
    valid_positions: int
    results: int
    forced_counts: int
    forced_tokens: int
    masks: int
    size: int

    @classmethod
    def for_geometry(cls, g: Geometry) -> "EntryLayout":
        off = 0
        parts = {}
        for name, nbytes in (
            ("desc_header", 12),  # step, batch_size, forward_us
            ("desc_rows", 4 * g.max_batch * DESC_ROW_WORDS),
            ("drafts", 4 * g.max_batch * max(g.max_drafts, 1)),
            ("out_counts", 4 * g.max_batch),
            ("out_tokens", 4 * g.max_batch * g.max_positions),
            ("mask_status", 4),
            ("valid_positions", 4 * g.max_batch),
            ("results", 4 * g.max_batch * RESULT_WORDS),
            ("forced_counts", 4 * g.max_batch),
            ("forced_tokens", 4 * g.max_batch * g.max_positions),
        ):
            parts[name] = off
            off = _align(off + nbytes)
        off = _align(off, 4096)  # masks page-aligned: copied to the device as one block
        parts["masks"] = off
        off = _align(off + 4 * g.max_rows * g.mask_words, 4096)
        return cls(size=off, **parts)


def region_bytes(g: Geometry) -> int:
    return HEADER_BYTES + g.depth * EntryLayout.for_geometry(g).size


def entry_offset(g: Geometry, step: int) -> int:
    return HEADER_BYTES + (step % g.depth) * EntryLayout.for_geometry(g).size


def seq_reached(value: int, target: int) -> bool:
    """Wrap-safe `value >= target` for 32-bit sequence numbers (what cuStreamWaitValue32 GEQ does)."""
    return ((value - target) & 0xFFFFFFFF) < 0x80000000
