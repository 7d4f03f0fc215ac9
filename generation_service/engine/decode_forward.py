"""The decode forward over the persistent buffers: one token per row, graph safe.

Two versions of the same step (docs/gpu.md has their H200 timings):
- fused (default for Llama layouts): the model's weights with q/k/v and gate/up concatenated,
  Triton add+RMSNorm, RoPE+KV write and silu*mul (`kernels/decode_fused.py`), the Triton attention
  backend: ~10 launches per layer;
- torch: the model's own modules around the same GEMMs and attention: ~36 launches per layer.
Both read input ids, positions, page tables and seq_lens from `DecodeBuffers`; padding rows
(seq_len 0, page table 0) write only into the dummy page. `tokens` runs either layer loop
over any T token slots, their positions and cache slots and an attention callable: decode
passes one token per row and the paged decode attention, the speculative verify graphs
(`verify_graphs.py`) b rows x w tokens and the extend attention. The fused loop starts from
`kernels/decode_prologue.py`: embedding, cos/sin and (decode) cache slots in one launch.
The fused version's GEMMs are cuBLAS (F.linear); for buckets <= `gemv_max_batch` each projection
instead asks `kernels/gemv.py`'s MEASURED table (H200, bf16) and runs the Triton skinny GEMM
where it beat cuBLAS at that shape and bucket (gate_up with silu*mul fused in), cuBLAS elsewhere.
Its weights carry the layer norms' weights (qkv: input_layernorm's, gate_up:
post_attention_layernorm's; `fuse_layer_weights`), so its norm kernels run without a weight,
and where both GEMMs around a norm run Triton the norm folds into them (`Projections`): the
producer (o_proj, down) adds the residual and sums squares, the consumer (gate_up, the next
qkv) normalises. Launches per layer: add+norm, qkv, rope+kv write, attention (2), o_proj,
add+norm, gate_up (+ silu*mul on cuBLAS), down: 9-10; each folded norm one fewer (7 at one row
on the 8B and 1B shapes, where all four projections run Triton; `gemv_plan` says which).
FP8 models (`model/quantization/`): each projection an `Fp8Weight` (q/k/v and gate/up stacked
with their per-channel scales); cuBLAS's place is `kernels/fp8_gemm.py` (torch._scaled_mm),
the GEMV buckets run `kernels/gemv.py` on FP8 rows; norms stay kernels (an FP8 weight cannot
carry a norm weight without a second rounding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from generation_service.engine.cuda_graphs import DecodeBuffers
from generation_service.engine.kv_cache import KVCache
from generation_service.model.layers import apply_rope
from generation_service.model.quantization.linear import Fp8Linear
from generation_service.model.quantization.weight import Fp8Weight


@dataclass
class DecodeMeta:
    """What the attention backend reads (AttentionMetadata)."""

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor


@dataclass
class LayerWeights:
    """Per-layer projections concatenated once so a decode step runs 2 GEMMs instead of 5.
    norms_folded: qkv carries input_layernorm's weight and gate_up post_attention_layernorm's
    (W * g, `fuse_layer_weights`), so the norms in front of them run without a weight."""

    qkv: torch.Tensor | Fp8Weight
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor | Fp8Weight
    norms_folded: bool = False


@dataclass(frozen=True)
class Projections:
    """The GEMMs of one fused step: cuBLAS, or per projection whichever of cuBLAS and the Triton
    skinny GEMM won on the H200 (`kernels.gemv.linear` / `gate_up_silu`) at small buckets.
    fold_*: that RMSNorm runs inside the Triton GEMMs around it, not as a kernel (kernels/gemv.py,
    "Folded RMSNorm"): its producer adds the residual (`add_residual`), its consumer normalises
    (`rms`). Set only where both GEMMs run Triton and the weights carry the norm weights."""

    linear: Callable  # (x, weight, bias, rms=None) -> x @ weight^T + bias; rms: x's gemv.RowRms
    gate_up_silu: Callable  # (x, [gate; up], rms=None) -> silu(x @ gate^T) * (x @ up^T)
    add_residual: Callable | None = None  # (x, weight, bias, residual, eps) -> (h, h's RowRms)
    fold_post_norm: bool = False  # o_proj -> post_attention_layernorm -> gate_up
    fold_input_norm: bool = False  # down -> the next layer's input_layernorm -> qkv (not layer 0)


def _cublas_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None,
                   rms=None) -> torch.Tensor:
    assert rms is None, "a folded RMSNorm runs in Triton GEMMs only"
    if isinstance(weight, Fp8Weight):
        from generation_service.kernels.fp8_gemm import fp8_linear
        return fp8_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _cublas_gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor | Fp8Weight, rms=None) -> torch.Tensor:
    from generation_service.kernels.decode_fused import silu_mul
    assert rms is None, "a folded RMSNorm runs in Triton GEMMs only"
    return silu_mul(_cublas_linear(x, gate_up, None))


def projection_weight(linear: torch.nn.Module) -> torch.Tensor | Fp8Weight:
    """What the GEMMs take for one of the model's linear layers."""
    return linear.fp8_weight() if isinstance(linear, Fp8Linear) else linear.weight  # (block-scaled: dense at load)


CUBLAS = Projections(_cublas_linear, _cublas_gate_up_silu)  # every GEMM on cuBLAS (any rows)
PLAN_NAMES = ("input_norm", "qkv", "o_proj", "post_attention_norm", "gate_up_silu", "down", "lm_head")


def _stack(linears: list[torch.nn.Module]) -> torch.Tensor | Fp8Weight:
    """Projections of one input stacked along N: FP8 with their scales where all are FP8 layers
    the kernels take, else dense (an FP8 layer among them dequantized once)."""
    if all(isinstance(p, Fp8Linear) and p.runs_fp8_kernels for p in linears):
        return Fp8Weight.cat([p.fp8_weight() for p in linears])
    dtype = next((p.weight.dtype for p in linears if not isinstance(p, Fp8Linear)), torch.bfloat16)
    return torch.cat([p.dequantized_weight(dtype) if isinstance(p, Fp8Linear) else p.weight for p in linears])


def fuse_layer_weights(model, *, fold_norms: bool = False) -> list[LayerWeights]:
    """Each layer's q/k/v and gate/up concatenated (copies: the model's parameters, which its
    modules and prefill use, stay as they are). fold_norms: qkv's columns scaled by
    input_layernorm's weight g and gate_up's by post_attention_layernorm's, rounded once to the
    weight dtype: rmsnorm(h) * g @ W^T = rmsnorm(h) @ (W * g)^T."""
    fused = []
    with torch.no_grad():
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            bias = None
            if a.q_proj.bias is not None:
                bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            if any(isinstance(p, Fp8Linear) for p in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj)):
                # FP8: stacked with their scales, the norms unfolded
                fused.append(LayerWeights(_stack([a.q_proj, a.k_proj, a.v_proj]), bias,
                                          _stack([m.gate_proj, m.up_proj])))
                continue
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            if fold_norms:  # (N, K) * (K,): in fp32, one rounding
                qkv.mul_(layer.input_layernorm.weight)
                gate_up.mul_(layer.post_attention_layernorm.weight)
            fused.append(LayerWeights(qkv, bias, gate_up, norms_folded=fold_norms))
    return fused


class DecodeForward:
    """Callable: bucket -> logits, reading the persistent buffers of one runner.

    gemv_max_batch: buckets up to this many rows run each GEMM with `kernels/gemv.py` where its
    MEASURED table says Triton wins there, cuBLAS otherwise (fused path only; 0 = cuBLAS
    everywhere; `gemv_plan` says which). Read per call, so set it before capture. Default 8:
    the rows the table was measured at (shapes it does not know stay on cuBLAS).
    The fused path's weights carry the layer norms' weights (`fuse_layer_weights`), so its norm
    kernels run without one; fold_norms (read per call) folds a norm into the GEMMs around it
    where both run Triton (`Projections`); False keeps every norm a kernel (A/B, profile_step.py).
    """

    def __init__(self, model, kv: KVCache, buffers: DecodeBuffers, *, fuse_weights: bool = True,
                 fused_ops: bool | None = None, gemv_max_batch: int = 8) -> None:
        from generation_service.kernels import get_attention_backend
        self.model, self.config, self.kv, self.buffers = model, model.config, kv, buffers
        if fused_ops is None:  # Triton element-wise fusions: Llama layout without q/k norms
            fused_ops = fuse_weights and not self.config.qk_norm and self.config.head_dim % 32 == 0
        self.fused_ops = fused_ops
        # the torch path runs the model's norms: only the fused path takes folded weights
        self.weights = fuse_layer_weights(model, fold_norms=fused_ops) if fuse_weights else None
        if fused_ops:  # cos/sin of every position the cache holds, by the model's own rotary
            positions = torch.arange(buffers.page_table.shape[1] * kv.page_size, device=kv.device)
            self._rope_tables = model.rotary(positions, model.model.embed_tokens.weight.dtype)
        if not 0 <= gemv_max_batch <= 16:  # kernels.gemv.MAX_ROWS (not imported: triton)
            raise ValueError(f"gemv_max_batch must be in 0..16, got {gemv_max_batch}")
        self.gemv_max_batch = gemv_max_batch
        self.fused_prologue = True  # read per call; False: the torch prologue (A/B, profile_step.py)
        self.fold_norms = True  # read per call; False: every norm a kernel (A/B, profile_step.py)
        self.attention = get_attention_backend("triton")
        self._extend_lens = torch.ones(buffers.max_batch, dtype=torch.int32, device=kv.device)

    @property
    def publishes_inputs(self) -> bool:
        """Whether `__call__` can publish inputs_seq: its first launch is the fused prologue."""
        return self.fused_ops and self.fused_prologue

    def __call__(self, bucket: int, publish: tuple[torch.Tensor, torch.Tensor] | None = None,
                 before_head: Callable[[], None] | None = None) -> torch.Tensor:
        """(bucket, vocab) logits of one token per row; graph safe (no host reads). Fused: the
        prologue, then 7-10 launches per layer (see the module docstring), bf16 logits
        (mask_sample reads them as they are); else the model's own modules (the v1 path,
        ~36 launches per layer), float32 logits. publish (needs `publishes_inputs`): the
        prologue also stores the device step counter into the step channel's inputs_seq word
        (`kernels/decode_prologue.py`). before_head: called right before the LM head is launched
        (the runner forks its mask read there)."""
        buf = self.buffers
        if publish is not None and not self.publishes_inputs:
            raise ValueError("publishing inputs_seq needs the fused prologue")
        if self.fused_ops:  # the cache slots come out of the prologue too
            residual, cos, sin, slot_ids = self._prologue(buf.input_ids[:bucket], buf.positions[:bucket],
                                                          buf.page_table[:bucket], publish)
            return self.fused_layers(residual, cos, sin, slot_ids, self._decode_attend(bucket),
                                     self._projections(bucket), before_head)
        ids = buf.input_ids[:bucket].clamp(0, self.config.vocab_size - 1)
        positions = buf.positions[:bucket]
        return self.torch_tokens(ids, positions, self._slot_ids(positions, buf.page_table[:bucket]),
                                 self._decode_attend(bucket), before_head)

    def _slot_ids(self, positions: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
        """(b,) int64 flattened cache slot of each row's new token (padding rows: dummy page)."""
        page_size = self.kv.page_size
        page_col = (positions // page_size).clamp(max=page_table.shape[1] - 1)
        pages = page_table.gather(1, page_col.unsqueeze(1)).squeeze(1).long()
        return pages * page_size + positions % page_size

    def _projections(self, bucket: int) -> Projections:
        """Per shape from gemv.MEASURED at buckets <= gemv_max_batch; a norm folds where its
        producer and consumer both run Triton (layer 0 stands for all, they share shapes)."""
        if bucket > self.gemv_max_batch:
            return CUBLAS
        from generation_service.kernels import gemv
        on_triton = {name: config is not None for name, config in self._gemv_configs(bucket).items()}
        fold = self.fold_norms and self.weights[0].norms_folded
        return Projections(gemv.linear, gemv.gate_up_silu, gemv.linear_add_residual,
                           fold_post_norm=fold and on_triton["o_proj"] and on_triton["gate_up_silu"],
                           fold_input_norm=fold and on_triton["down"] and on_triton["qkv"])

    def _gemv_configs(self, bucket: int) -> dict:
        """Projection -> its `gemv.measured_config` at this bucket (None: cuBLAS)."""
        from generation_service.kernels.gemv import measured_config
        layer, w = self.model.model.layers[0], self.weights[0]
        return {"qkv": measured_config(bucket, w.qkv),
                "o_proj": measured_config(bucket, projection_weight(layer.self_attn.o_proj)),
                "gate_up_silu": measured_config(bucket, w.gate_up, fused=True),
                "down": measured_config(bucket, projection_weight(layer.mlp.down_proj)),
                "lm_head": measured_config(bucket, self.model.output_weight)}

    def gemv_plan(self, bucket: int) -> dict[str, str]:
        """What the step runs at this bucket, in layer order (PLAN_NAMES): projection -> "cublas"
        or its Triton config; norm -> "folded" (into the GEMMs around it: `Projections`) or
        "kernel" (a launch of its own). input_norm "folded" means layers 1.. (layer 0's input
        norm is a kernel)."""
        if not self.fused_ops or bucket > self.gemv_max_batch:
            proj, configs = CUBLAS, {}
        else:
            proj, configs = self._projections(bucket), self._gemv_configs(bucket)
        plan = {name: str(configs[name]) if configs.get(name) is not None else "cublas"
                for name in PLAN_NAMES}
        plan["input_norm"] = "folded" if proj.fold_input_norm else "kernel"
        plan["post_attention_norm"] = "folded" if proj.fold_post_norm else "kernel"
        return plan

    def _decode_attend(self, bucket: int) -> Callable:
        """(q, layer index) -> attention of one query token per row over the paged cache."""
        cfg, buf, kv = self.config, self.buffers, self.kv
        meta = DecodeMeta(buf.page_table[:bucket], buf.seq_lens[:bucket], self._extend_lens[:bucket])
        scale = cfg.head_dim ** -0.5

        def attend(q: torch.Tensor, index: int) -> torch.Tensor:
            return self.attention.decode(q, kv.k[index], kv.v[index], meta, scale,
                                         sliding_window=cfg.sliding_window, **kv.scales(index))
        return attend

    def tokens(self, ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
               attend: Callable, proj: Projections | None = None,
               logits_indices: torch.Tensor | None = None,
               layer_ids: tuple[int, ...] | None = None) -> torch.Tensor:
        """(T, vocab) logits of T token slots (the verify graphs, verify_graphs.py; the mixed
        steps, mixed_forward.py, with `logits_indices`: (L, vocab) of those slots): ids (T,)
        already clamped, positions and flat cache slots (T,), `attend(q (T, Hq, D), layer)`
        the attention over the cache once the slots' K/V are written; cuBLAS GEMMs unless
        `proj` says otherwise; `layer_ids`: only these decoder layers, in order (a
        self-speculative draft, self_drafts.py). Graph safe."""
        if self.fused_ops:
            residual, cos, sin, _ = self._prologue(ids, positions)
            return self.fused_layers(residual, cos, sin, slot_ids, attend, proj or CUBLAS,
                                     logits_indices=logits_indices, layer_ids=layer_ids)
        return self.torch_tokens(ids, positions, slot_ids, attend, logits_indices=logits_indices,
                                 layer_ids=layer_ids)

    def _prologue(self, ids: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor | None = None,
                  publish: tuple[torch.Tensor, torch.Tensor] | None = None):
        """(embedded tokens, cos, sin, cache slots or None) in one launch (fused path), or
        without `fused_prologue` by the ~15 torch ops it replaces (an A/B baseline)."""
        if not self.fused_prologue:
            residual = self.model.model.embed_tokens(ids.clamp(0, self.config.vocab_size - 1))
            cos, sin = self.model.rotary(positions, residual.dtype)
            return residual, cos, sin, None if page_table is None else self._slot_ids(positions, page_table)
        from generation_service.kernels.decode_prologue import decode_prologue
        return decode_prologue(ids, positions, self.model.model.embed_tokens.weight, *self._rope_tables,
                               page_table, self.kv.page_size, publish)

    def fused_layers(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     slot_ids: torch.Tensor, attend: Callable, proj: Projections,
                     before_head: Callable[[], None] | None = None,
                     logits_indices: torch.Tensor | None = None,
                     layer_ids: tuple[int, ...] | None = None) -> torch.Tensor:
        """The fused layer loop over T token slots (one per row for decode): residual (T, hidden)
        the embedded tokens, cos/sin (T, D) at their positions (`kernels/decode_prologue.py`).
        Each norm's input x comes with rms = None (x normalised by a kernel) or with the RowRms of
        the raw residual stream x (a folded norm: the consumer GEMM normalises).
        logits_indices (L,) int64: logits of those token slots only (a prefill chunk needs none
        but its last); the last down projection, the final norm and the LM head run on L rows.
        layer_ids: the decoder layers to run, in order (default all)."""
        from generation_service.kernels.decode_fused import add_rmsnorm, rope_write_kv
        cfg, m, kv = self.config, self.model, self.kv
        layers = m.model.layers
        num_tokens = residual.shape[0]
        q_dim, eps = cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps
        order = range(len(layers)) if layer_ids is None else layer_ids
        input_norm, post_norm = self._norm_weights(order[0])
        x, residual = add_rmsnorm(residual, None, input_norm, eps)
        rms = None
        for position, index in enumerate(order):
            layer, w = layers[index], self.weights[index]
            qkv = proj.linear(x, w.qkv, w.qkv_bias, rms)
            q = rope_write_kv(qkv, cos, sin, kv.k[index], kv.v[index], slot_ids,
                              cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, **kv.scales(index))
            o = attend(q, index)
            x, residual, rms = self._add_norm(proj, proj.fold_post_norm, o.view(num_tokens, q_dim),
                                              layer.self_attn.o_proj, residual, post_norm)
            act = proj.gate_up_silu(x, w.gate_up, rms)
            if position + 1 == len(order):
                break
            input_norm, post_norm = self._norm_weights(order[position + 1])
            x, residual, rms = self._add_norm(proj, proj.fold_input_norm, act, layer.mlp.down_proj,
                                              residual, input_norm)
        down_proj = layers[order[-1]].mlp.down_proj
        if logits_indices is not None:  # per token from here on: only the rows that sample
            act, residual = act[logits_indices], residual[logits_indices]
        # the final norm keeps its weight: the LM head's weight may be the (tied) embedding
        x, _ = add_rmsnorm(proj.linear(act, projection_weight(down_proj), down_proj.bias), residual,
                           m.model.norm.weight, eps)
        if before_head is not None:
            before_head()
        return proj.linear(x, m.output_weight, None)

    def _norm_weights(self, index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The weights layer `index`'s input and post-attention norm kernels multiply by:
        None where its qkv and gate_up weights carry them (`LayerWeights.norms_folded`)."""
        if self.weights[index].norms_folded:
            return None, None
        layer = self.model.model.layers[index]
        return layer.input_layernorm.weight, layer.post_attention_layernorm.weight

    def _add_norm(self, proj: Projections, fold: bool, x: torch.Tensor, linear: torch.nn.Linear,
                  residual: torch.Tensor, norm_weight: torch.Tensor | None) -> tuple:
        """residual + linear(x), then the norm: (the next GEMM's input, the new residual, rms).
        fold: the GEMM adds the residual and leaves the norm to the next GEMM (input = the new
        residual, rms its RowRms); else add_rmsnorm after it (rms None)."""
        from generation_service.kernels.decode_fused import add_rmsnorm
        eps = self.config.rms_norm_eps
        if fold:
            h, rms = proj.add_residual(x, linear.weight, linear.bias, residual, eps)
            return h, h, rms
        delta = proj.linear(x, projection_weight(linear), linear.bias)
        normed, h = add_rmsnorm(delta, residual, norm_weight, eps)
        return normed, h, None

    def torch_tokens(self, ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                     attend: Callable, before_head: Callable[[], None] | None = None,
                     logits_indices: torch.Tensor | None = None,
                     layer_ids: tuple[int, ...] | None = None) -> torch.Tensor:
        """The unfused layer loop over T token slots; float32 logits (of `logits_indices` only,
        if given, and of `layer_ids` only, as in `fused_layers`)."""
        assert self.weights is None or not self.weights[0].norms_folded, "folded: for fused_layers"
        cfg, m, kv = self.config, self.model, self.kv
        num_tokens = ids.shape[0]
        hidden = m.model.embed_tokens(ids)  # (T, hidden)
        cos, sin = m.rotary(positions, hidden.dtype)
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for index in range(len(m.model.layers)) if layer_ids is None else layer_ids:
            layer = m.model.layers[index]
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            if self.weights is not None:
                w = self.weights[index]
                q, k, v = _cublas_linear(x, w.qkv, w.qkv_bias).split([q_dim, kv_dim, kv_dim], dim=-1)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)  # (T, Hq, D)
            k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # (T, Hkv, D)
            v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim).contiguous()
            if cfg.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self.attention.write_kv(k.contiguous(), v, kv.k[index], kv.v[index], slot_ids, **kv.scales(index))
            o = attend(q.contiguous(), index)
            hidden = hidden + attn.o_proj(o.reshape(num_tokens, q_dim))
            x = layer.post_attention_layernorm(hidden)
            if self.weights is not None:
                gate, up = _cublas_linear(x, self.weights[index].gate_up, None).chunk(2, dim=-1)
                hidden = hidden + layer.mlp.down_proj(F.silu(gate) * up)
            else:
                hidden = hidden + layer.mlp(x)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        hidden = m.model.norm(hidden)
        if before_head is not None:
            before_head()
        return F.linear(hidden, m.output_weight).float()
