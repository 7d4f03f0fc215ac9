"""Mixed steps as CUDA graphs: one captured forward per token bucket.

An eager mixed step (`MixedForward`) launches about eleven kernels a layer from Python; at serving
batch sizes those launches, not the GPU, set the step's time. Here the same forward is captured
once per bucket of T token slots (`MIXED_TOKEN_BUCKETS`, steps of at most 1.5x, so a step pays at
most a third more slots than it fills) over persistent inputs, and a step is: pack on the host
(`pack_mixed`), one copy of a pinned mirror of every input into its device twin, one replay.

What the graph of bucket T reads (rows padded to R = the largest decode bucket):
    tokens [0, T)   ids, positions, cache slots; padding: id 0, position 0, slot 0 (dummy page)
    rows [0, R)     page table rows; decode seq_lens (0 but for decode rows); extend seq_lens,
                    extend_lens and first tokens (0 but for extend rows); padding rows all 0
    tiles           the extend kernel's (row, m block) list, padded with row -1
    logits rows     min(T, R) token indices (padding: 0); the logits land in a persistent buffer
Attention per layer: the decode kernel over rows [0, min(R, T)) -- decode rows come first, one
token each; it writes zeros for the other rows' tokens -- then the extend kernel over the tile
list (`extend_attention_tiles`), which overwrites every extend row's tokens. Padding tokens'
outputs are zeros; their K/V land in the dummy page.
"""
from __future__ import annotations

import logging

import torch

from generation_service.engine.cuda_graphs import FREE, bucket_for, capture_graphs
from generation_service.engine.decode_forward import CUBLAS, DecodeForward
from generation_service.engine.fed_back import FedBack
from generation_service.engine.mixed_forward import MixedLayout, pack_mixed
from generation_service.engine.pinned import PinnedStaging
from generation_service.engine.scheduler import ScheduledRow

log = logging.getLogger(__name__)

MIXED_TOKEN_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def extend_block_m(num_tokens: int, group: int) -> int:
    """The extend kernel's query tile of a graph of `num_tokens` slots (as `extend_attention`
    picks it for a prefill of that many (token, head) rows)."""
    rows = num_tokens * group
    return 128 if rows >= 512 else max(16, min(64, 1 << (rows - 1).bit_length()))


class _Mirror:
    """Named fields of one flat pinned host tensor and of its device twin (same offsets); `host`
    holds numpy views of the host fields (a step's fill is numpy: a torch op on a small CPU
    tensor costs several microseconds of dispatch)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> None:
        total = sum(_numel(shape) for shape in shapes.values())
        self.host_flat = torch.zeros(total, dtype=dtype, pin_memory=device.type == "cuda")
        self.device_flat = torch.zeros(total, dtype=dtype, device=device)
        self.host, self.device, offset = {}, {}, 0
        for name, shape in shapes.items():
            n = _numel(shape)
            self.host[name] = self.host_flat[offset:offset + n].view(shape).numpy()
            self.device[name] = self.device_flat[offset:offset + n].view(shape)
            offset += n

    def upload(self) -> None:
        self.device_flat.copy_(self.host_flat, non_blocking=True)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


class MixedGraphs:
    """Captured mixed steps over `forward`'s weights and cache. Invariants: every bucket's graph
    reads only the mirrors' device fields and writes only the cache, its pool and `logits`;
    the host mirror is rewritten only after the previous step's copy completed (`_copied`).
    layer_ids: the graphs run only these decoder layers (self-speculative drafts, self_drafts.py)."""

    def __init__(self, forward: DecodeForward, max_rows: int, max_pages: int,
                 buckets: tuple[int, ...] = MIXED_TOKEN_BUCKETS, layer_ids: tuple[int, ...] | None = None) -> None:
        self.forward, self.kv, self.config = forward, forward.kv, forward.config
        self.layer_ids = layer_ids
        self.device = forward.kv.device
        self.max_rows, self.max_pages = max_rows, max_pages
        self.buckets = tuple(b for b in buckets if b >= 16)
        self.max_tokens = self.buckets[-1]
        self.group = self.config.num_heads // self.config.num_kv_heads
        max_tiles = max(self._num_tiles(b) for b in self.buckets)
        t, r = self.max_tokens, max_rows
        self.ints = _Mirror({"input_ids": (t,), "positions": (t,), "slot_ids": (t,), "logits_indices": (r,),
                             "extend_start": (r,), "tile_rows": (max_tiles,), "tile_blocks": (max_tiles,)},
                            torch.int64, self.device)
        self.int32s = _Mirror({"page_table": (r, max_pages), "decode_seq_lens": (r,), "seq_lens": (r,),
                               "extend_lens": (r,)}, torch.int32, self.device)
        self.ints.host["tile_rows"].fill(-1)
        self.ints.upload()
        dtype = forward.model.model.embed_tokens.weight.dtype if forward.fused_ops else torch.float32
        self.logits = torch.zeros(r, self.config.vocab_size, dtype=dtype, device=self.device)
        self.graphs = None
        self._capturing = False
        self._copied: torch.cuda.Event | None = None
        self._fed_staging = PinnedStaging(self.device)
        self.num_steps = 0

    def _num_tiles(self, bucket: int) -> int:
        from generation_service.kernels.extend_attention import max_tiles
        return max_tiles(bucket, self.max_rows, self.group, extend_block_m(bucket, self.group))

    # ---- which steps ------------------------------------------------------------------------
    def token_bucket(self, num_tokens: int) -> int:
        """The slots a step of `num_tokens` tokens replays (its bucket); itself past the largest."""
        return bucket_for(num_tokens, self.buckets) if num_tokens <= self.max_tokens else num_tokens

    def can_run(self, rows: list[ScheduledRow]) -> bool:
        """No drafts (verify rows go eager), rows and tokens within the buffers."""
        return (0 < len(rows) <= self.max_rows and sum(len(row.input_ids) for row in rows) <= self.max_tokens
                and all(not row.drafts and len(row.request.pages) <= self.max_pages for row in rows))

    # ---- the step body ----------------------------------------------------------------------
    def _attend(self, bucket: int):
        from generation_service.kernels.decode_attention import decode_attention
        from generation_service.kernels.extend_attention import extend_attention_tiles
        ints, int32s, kv = self.ints.device, self.int32s.device, self.kv
        decode_rows = min(self.max_rows, bucket)
        num_tiles, block_m = self._num_tiles(bucket), extend_block_m(bucket, self.group)
        scale, window = self.config.head_dim ** -0.5, self.config.sliding_window

        def attend(q: torch.Tensor, index: int) -> torch.Tensor:
            q = q.contiguous()
            out = torch.zeros_like(q)
            k, v, scales = kv.k[index], kv.v[index], kv.scales(index)
            decode_attention(q[:decode_rows], k, v, int32s["page_table"][:decode_rows],
                             int32s["decode_seq_lens"][:decode_rows], scale, out=out[:decode_rows],
                             sliding_window=window, **scales)
            extend_attention_tiles(q, k, v, int32s["page_table"], int32s["seq_lens"], int32s["extend_lens"],
                                   ints["extend_start"], ints["tile_rows"][:num_tiles],
                                   ints["tile_blocks"][:num_tiles], scale, block_m, out, sliding_window=window,
                                   **scales)
            return out
        return attend

    def body(self, bucket: int, variant=FREE) -> None:
        ints = self.ints.device
        num_logits = min(self.max_rows, bucket)
        logits = self.forward.tokens(ints["input_ids"][:bucket], ints["positions"][:bucket],
                                     ints["slot_ids"][:bucket], self._attend(bucket), CUBLAS,
                                     logits_indices=ints["logits_indices"][:num_logits], layer_ids=self.layer_ids)
        self.logits[:num_logits].copy_(logits)

    def warmup(self, bucket: int) -> None:
        """The body on the resting inputs: every row and tile padding (K/V into the dummy page)."""
        self.body(bucket)

    @torch.no_grad()
    def capture(self) -> float:
        self.graphs = capture_graphs(self, self.buckets, (FREE,))
        log.info("mixed-step graphs (%d token buckets up to %d%s) captured in %.2f s", len(self.buckets),
                 self.max_tokens, "" if self.layer_ids is None else f", layers {list(self.layer_ids)}",
                 self.graphs.capture_s)
        return self.graphs.capture_s

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def __call__(self, rows: list[ScheduledRow], use_graph: bool = True,
                 fed_back: FedBack | None = None) -> torch.Tensor:
        """(L, vocab) logits of the rows' sampling positions (batch order), by one replay."""
        layout = pack_mixed(rows, self.kv.page_size, self.config.vocab_size)
        bucket = bucket_for(layout.num_tokens, self.buckets)
        if self._copied is not None:
            self._copied.synchronize()
        self._fill(layout, bucket)
        self.ints.upload()
        self.int32s.upload()
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        if fed_back is not None:
            fed_back.apply(self.ints.device["input_ids"], layout.row_starts, self._fed_staging)
        if use_graph and self.graphs is not None:
            self.graphs.replay(bucket, FREE)
        else:
            self.body(bucket)
        self.num_steps += 1
        return self.logits[:len(layout.logits_indices)]

    def _fill(self, layout: MixedLayout, bucket: int) -> None:
        """The host mirror of one step: the layout, then padding up to the bucket."""
        from generation_service.kernels.extend_attention import tile_array
        ints, int32s = self.ints.host, self.int32s.host
        n, d, rows = layout.num_tokens, layout.num_decode_rows, layout.seq_lens.shape[0]
        for name in ("input_ids", "positions", "slot_ids"):
            ints[name][:n] = getattr(layout, name)
            ints[name][n:bucket] = 0
        num_logits = len(layout.logits_indices)
        ints["logits_indices"][:num_logits] = layout.logits_indices
        ints["logits_indices"][num_logits:] = 0
        width = layout.page_table.shape[1]
        int32s["page_table"][:rows, :width] = layout.page_table
        for name in ("decode_seq_lens", "seq_lens", "extend_lens"):
            int32s[name][:] = 0
        int32s["decode_seq_lens"][:d] = layout.seq_lens[:d]
        int32s["seq_lens"][d:rows] = layout.seq_lens[d:]
        int32s["extend_lens"][d:rows] = layout.extend_lens[d:]
        ints["extend_start"][:] = 0
        ints["extend_start"][d:rows] = layout.extend_start + d
        tile_rows, tile_blocks = tile_array(int32s["extend_lens"][:rows], self.group,
                                            extend_block_m(bucket, self.group))
        ints["tile_rows"][:] = -1
        ints["tile_rows"][:len(tile_rows)] = tile_rows
        ints["tile_blocks"][:len(tile_blocks)] = tile_blocks

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
