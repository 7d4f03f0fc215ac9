"""Time every Triton kernel against its torch reference on the GPU.

    python benchmarks/kernels.py --out benchmarks/results/kernels-h200.json [--quick]

Llama-3.1-8B attention shapes (32 q heads, 8 kv heads, head_dim 128, bf16, page 16),
batch 1..128, context 512..8k; the sampler over a 131k vocabulary. Times are medians of
``triton.testing.do_bench`` (CUDA events, L2 flushed between runs) on random data. Each
record carries the bytes the kernel must move and the floor those bytes give at the copy
bandwidth measured in the same run, so "x floor" says how far from memory speed it is.
"torch" is the reference in the kernel's room; for attention "sdpa" is torch's fused
attention over a contiguous (unpaged) cache of the same size, a stronger baseline.
"gemv" (`--only gemv`, ~1 minute): the decode projections at M = 1..8, cuBLAS vs every
candidate config of kernels/gemv.py, each timed as a CUDA graph of one launch per layer over
distinct weight copies (as in a decode step: no weight stays in L2), plus every projection of
a whole step in one graph (cuBLAS, every projection on gemv, the gemv.MEASURED hybrid).
"gemv_decode" (~30 s): the whole free decode step (GpuDecodeRunner graphs, random 8B/1B
weights, context 512) with `gemv_max_batch` 0 (cuBLAS) vs 8 (gemv where gemv.MEASURED says it
won, cuBLAS elsewhere; each record lists that plan).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._harness import VOCAB  # noqa: E402

DEV = "cuda"
HQ, HKV, D, PAGE = 32, 8, 128, 16


def bench(fn, rep_ms: int = 100) -> float:
    fn()  # compile / warm up outside the timed region
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(2 ** 28, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def record(kernel, case, triton_ms, torch_ms, nbytes, bw, **extra):
    floor_ms = nbytes / bw / 1e6 if nbytes else None
    rec = dict(kernel=kernel, case=case, triton_ms=triton_ms, torch_ms=torch_ms,
               speedup=(torch_ms / triton_ms) if torch_ms else None, bytes=nbytes,
               floor_ms=floor_ms, x_floor=(triton_ms / floor_ms) if floor_ms else None)
    rec.update(extra)
    return rec


def paged_cache(batch, ctx):
    pages_per_row = -(-ctx // PAGE)
    num_pages = 1 + batch * pages_per_row
    k = torch.randn(num_pages, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = (torch.randperm(num_pages - 1, device=DEV) + 1).int().view(batch, pages_per_row)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    return k, v, table, seq_lens


def bench_decode(batches, contexts, bw):
    from generation_service.kernels.decode_attention import (decode_attention,
                                                             decode_attention_torch)
    out = []
    for ctx in contexts:
        for batch in batches:
            k, v, table, seq_lens = paged_cache(batch, ctx)
            q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
            t_tri = bench(lambda: decode_attention(q, k, v, table, seq_lens, D ** -0.5))
            t_ref = bench(lambda: decode_attention_torch(q, k, v, table, seq_lens, D ** -0.5,
                                                         compute_dtype=torch.bfloat16), 50)
            kc = torch.randn(batch, HKV, ctx, D, device=DEV, dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            q4 = q.view(batch, HQ, 1, D)
            t_sdpa = bench(lambda: F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True))
            del kc, vc, k, v
            nbytes = 2 * batch * ctx * HKV * D * 2 + 2 * q.numel() * 2
            out.append(record("decode_attention", f"B={batch} ctx={ctx}", t_tri, t_ref,
                              nbytes, bw, sdpa_ms=t_sdpa))
    return out


def bench_tuning(bw):
    """A few tile configs at representative shapes, to pick the defaults from data."""
    from generation_service.kernels.decode_attention import decode_attention
    from generation_service.kernels.extend_attention import extend_attention
    out = []
    decode_configs = [dict(block_n=64, num_warps=4, num_stages=2),  # the default
                      dict(block_n=32, num_warps=4, num_stages=3),
                      dict(block_n=128, num_warps=8, num_stages=2),
                      dict(block_n=64, num_warps=2, num_stages=3)]
    for batch, ctx in ((1, 8192), (32, 2048), (128, 2048)):
        k, v, table, seq_lens = paged_cache(batch, ctx)
        q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
        nbytes = 2 * batch * ctx * HKV * D * 2
        for cfg in decode_configs:
            try:
                t = bench(lambda: decode_attention(q, k, v, table, seq_lens, D ** -0.5, **cfg))
            except Exception as exc:  # e.g. out of shared memory: keep the other configs
                out.append(dict(kernel="tune_decode", case=str(cfg), error=repr(exc)))
                continue
            out.append(record("tune_decode", f"B={batch} ctx={ctx} {cfg}", t, None, nbytes,
                              bw))
    extend_configs = [dict(block_m=128, block_n=64, num_warps=8),  # prefill default
                      dict(block_m=64, block_n=64, num_warps=4),
                      dict(block_m=128, block_n=128, num_warps=8),
                      dict(block_m=64, block_n=32, num_warps=4, num_stages=3)]
    new = 4096
    k, v, table, seq_lens = paged_cache(1, new)
    extend_lens = torch.full((1,), new, dtype=torch.int32, device=DEV)
    q = torch.randn(new, HQ, D, device=DEV, dtype=torch.bfloat16)
    flops = 4 * HQ * D * new * (new + 1) / 2
    for cfg in extend_configs:
        try:
            t = bench(lambda: extend_attention(q, k, v, table, seq_lens, extend_lens,
                                               D ** -0.5, max_extend_len=new, **cfg))
        except Exception as exc:
            out.append(dict(kernel="tune_extend", case=str(cfg), error=repr(exc)))
            continue
        out.append(record("tune_extend", f"prefill {new} {cfg}", t, None, 0, bw,
                          tflops=flops / t / 1e9))
    return out


def bench_extend(bw, quick):
    from generation_service.kernels.extend_attention import (extend_attention,
                                                             extend_attention_torch)
    cases = [(1, 0, n) for n in ((512, 2048) if quick else (512, 2048, 8192))]
    cases += [(1, 4096, 512)]  # a prefill chunk over a cached prefix
    cases += [(b, 2048, 4) for b in ((1, 32) if quick else (1, 8, 32, 64, 128))]  # verify
    out = []
    for batch, prefix, new in cases:
        k, v, table, seq_lens = paged_cache(batch, prefix + new)
        extend_lens = torch.full((batch,), new, dtype=torch.int32, device=DEV)
        q = torch.randn(batch * new, HQ, D, device=DEV, dtype=torch.bfloat16)
        t_tri = bench(lambda: extend_attention(q, k, v, table, seq_lens, extend_lens,
                                               D ** -0.5, max_extend_len=new))
        t_ref = bench(lambda: extend_attention_torch(q, k, v, table, seq_lens, extend_lens,
                                                     D ** -0.5, compute_dtype=torch.bfloat16),
                      50)
        flops = 4 * batch * HQ * D * new * (prefix + (new + 1) / 2)
        nbytes = 2 * batch * (prefix + new) * HKV * D * 2 + 2 * q.numel() * 2
        extra = dict(tflops=flops / t_tri / 1e9)
        if prefix == 0 and batch == 1:
            qs = q.view(1, new, HQ, D).transpose(1, 2)
            ks = torch.randn(1, HKV, new, D, device=DEV, dtype=torch.bfloat16)
            vs = torch.randn_like(ks)
            extra["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, enable_gqa=True))
        out.append(record("extend_attention", f"B={batch} prefix={prefix} new={new}", t_tri,
                          t_ref, nbytes, bw, **extra))
    return out


def bench_prepare(batches, bw):
    from generation_service.kernels.prepare_inputs import (
        PreparedInputs, prepare_decode_inputs, prepare_decode_inputs_torch)
    out = []
    for width in (1, 4):
        for rows in batches:
            table = torch.randint(1, 10000, (rows, 512), dtype=torch.int32, device=DEV)
            before = torch.randint(0, 8000, (rows,), dtype=torch.int32, device=DEV)
            num_new = torch.full((rows,), width, dtype=torch.int32, device=DEV)
            ids = torch.randint(0, VOCAB, (rows * width,), device=DEV)
            num_rows = torch.tensor([max(1, rows - 1)], dtype=torch.int32, device=DEV)
            bufs = PreparedInputs.allocate(rows, rows * width, DEV)
            args = (ids, before, num_new, table, num_rows, bufs, PAGE, VOCAB, width)
            t_tri = bench(lambda: prepare_decode_inputs(*args))
            t_ref = bench(lambda: prepare_decode_inputs_torch(*args), 20)
            out.append(record("prepare_inputs", f"rows={rows} width={width}", t_tri, t_ref,
                              0, bw))
    return out


def bench_kv_write(bw):
    from generation_service.kernels.kv_write import write_kv, write_kv_torch
    out = []
    k_cache = torch.randn(20001, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    for tokens in (1, 32, 128, 512, 4096):
        slots = torch.randperm(20000 * PAGE, device=DEV)[:tokens] + PAGE
        k = torch.randn(tokens, HKV, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        t_tri = bench(lambda: write_kv(k, v, k_cache, v_cache, slots))
        t_ref = bench(lambda: write_kv_torch(k, v, k_cache, v_cache, slots))
        out.append(record("kv_write", f"T={tokens}", t_tri, t_ref, 2 * 2 * k.numel() * 2, bw))
    return out


def torch_sample_baseline(logits, bitmask, temperature, top_k, top_p, greedy):
    """What an unfused torch sampler does: unpack mask, mask, then argmax or sort+sample."""
    from generation_service.kernels.sample_reference import apply_mask_torch
    x = apply_mask_torch(logits, bitmask)
    if greedy:
        return x.argmax(-1)
    x = x / temperature[:, None]
    sorted_x, order = x.sort(-1, descending=True)
    ranks = torch.arange(x.shape[1], device=x.device)
    sorted_x = sorted_x.masked_fill((ranks[None] >= top_k[:, None]) & (top_k[:, None] > 0),
                                    float("-inf"))
    probs = sorted_x.softmax(-1)
    sorted_x = sorted_x.masked_fill(probs.cumsum(-1) - probs >= top_p[:, None], float("-inf"))
    choice = torch.multinomial(sorted_x.softmax(-1), 1)
    return order.gather(1, choice).squeeze(1)


def bench_mask_sample(batches, bw):
    from generation_service.kernels.mask_sample import mask_sample
    modes = [("greedy", False, 0.0, 0, 1.0), ("greedy+mask", True, 0.0, 0, 1.0),
             ("sample+mask", True, 0.7, 0, 1.0), ("topk50+topp0.9+mask", True, 0.7, 50, 0.9)]
    out = []
    for rows in batches:
        logits = torch.randn(rows, VOCAB, device=DEV) * 4
        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, VOCAB // 32), device=DEV,
                                dtype=torch.int32)
        seeds = torch.randint(0, 2 ** 62, (rows,), device=DEV)
        steps = torch.randint(0, 2 ** 20, (rows,), device=DEV)
        for name, use_mask, temp, k, p in modes:
            mask = bitmask if use_mask else None
            temperature = torch.full((rows,), temp, device=DEV)
            top_k = torch.full((rows,), k, dtype=torch.int32, device=DEV)
            top_p = torch.full((rows,), p, device=DEV)
            filters = k > 0 or p < 1.0
            t_tri = bench(lambda: mask_sample(logits, mask, temperature, top_k, top_p, seeds,
                                              steps, enable_filters=filters))
            t_ref = bench(lambda: torch_sample_baseline(logits, mask, temperature, top_k,
                                                        top_p, temp == 0.0))
            nbytes = logits.numel() * 4 + (bitmask.numel() * 4 if use_mask else 0)
            extra = {}
            if filters:  # probes per search pass: 1 = bisection (32 passes), 16 = 8 passes
                for probes in (1, 4, 16):
                    extra[f"probes{probes}_ms"] = bench(lambda: mask_sample(
                        logits, mask, temperature, top_k, top_p, seeds, steps,
                        search_probes=probes))
            out.append(record("mask_sample", f"R={rows} {name}", t_tri, t_ref, nbytes, bw,
                              **extra))
    return out


def bench_norm_rope(bw):
    from generation_service.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_torch
    from generation_service.kernels.rotary import rope_qk_, rope_qk_torch
    out = []
    hidden = 4096
    weight = torch.rand(hidden, device=DEV, dtype=torch.bfloat16) + 0.5
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D)
    for tokens in (1, 64, 128, 4096):
        x = torch.randn(tokens, hidden, device=DEV, dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        t_tri = bench(lambda: fused_add_rmsnorm(x, residual, weight, 1e-5))
        t_ref = bench(lambda: fused_add_rmsnorm_torch(x, residual, weight, 1e-5))
        out.append(record("fused_add_rmsnorm", f"T={tokens} dim={hidden}", t_tri, t_ref,
                          4 * x.numel() * 2, bw))
        q = torch.randn(tokens, HQ, D, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(tokens, HKV, D, device=DEV, dtype=torch.bfloat16)
        positions = torch.randint(0, 8192, (tokens,), device=DEV)
        t_tri = bench(lambda: rope_qk_(q, k, positions, inv_freq))
        t_ref = bench(lambda: rope_qk_torch(q, k, positions, inv_freq))
        out.append(record("rope_qk", f"T={tokens}", t_tri, t_ref,
                          2 * (q.numel() + k.numel()) * 2, bw))
    return out


GEMV_MODELS = {  # model: (hidden, intermediate, q heads x head_dim, kv heads x head_dim, layers)
    "8B": (4096, 14336, 32 * 128, 8 * 128, 32),
    "1B": (2048, 8192, 32 * 64, 8 * 64, 16),
}


def graph_ms(fns, rep_ms: int = 40) -> float:
    """ms of one replay of a CUDA graph that launches fns in order (compiled/warmed first)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    ms = bench(graph.replay, rep_ms)
    del graph
    return ms


def gemv_weights(hidden, inter, q_dim, kv_dim, layers):
    """name -> (N, K, one weight per layer); gate_up is [gate; up] (2I rows); the LM head is one
    weight launched 4 times (1 GB: never in L2)."""
    def copies(n, k, count):
        return [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(count)]
    shapes = {"qkv": (q_dim + 2 * kv_dim, hidden), "o_proj": (hidden, q_dim),
              "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    weights = {name: (n, k, copies(n, k, layers)) for name, (n, k) in shapes.items()}
    weights["lm_head"] = (VOCAB, hidden, copies(VOCAB, hidden, 1) * 4)
    return weights


def extra_m1_configs() -> list:
    """`--extra-m1`: more programs (BLOCK_N 8 on CUDA cores: N / 8 programs) or deeper pipelines
    for one row, where the projections under 64 MB stream well under the copy bandwidth
    (benchmarks/results/profile-h200-fold.json)."""
    from generation_service.kernels.gemv import GemvConfig
    return [GemvConfig(8, 1024, num_stages=3, use_dot=False), GemvConfig(8, 512, use_dot=False),
            GemvConfig(16, 512, num_warps=8, num_stages=3, use_dot=False),
            GemvConfig(16, 256, num_stages=6), GemvConfig(16, 128, num_stages=8),
            GemvConfig(4, 2048, num_stages=3, use_dot=False), GemvConfig(8, 1024, use_dot=False),
            GemvConfig(8, 2048, num_warps=8, num_stages=3, use_dot=False),
            GemvConfig(4, 1024, num_stages=4, use_dot=False)]


def extra_m1_fused_configs() -> list:
    """gate_up + silu: two W tiles a step, so half the K tile of the one-row configs above."""
    from generation_service.kernels.gemv import GemvConfig
    return [GemvConfig(8, 512, num_stages=3, use_dot=False), GemvConfig(4, 1024, num_stages=3, use_dot=False),
            GemvConfig(8, 1024, num_warps=8, num_stages=3, use_dot=False)]


def bench_gemv(bw, quick, extra_m1=False):
    """Per projection and M: cuBLAS vs each gemv candidate (gate_up: F.linear + silu_mul vs the
    fused gemv_gate_up_silu); then all projections of a step, cuBLAS vs gemv defaults.
    extra_m1: at one row also `extra_m1_configs()` (gate_up: `extra_m1_fused_configs()`)."""
    from generation_service.kernels.decode_fused import silu_mul
    from generation_service.kernels.gemv import candidate_configs, gemv, gemv_gate_up_silu
    out = []
    for model, dims in GEMV_MODELS.items():
        weights = gemv_weights(*dims)
        hidden, inter = dims[0], dims[1]
        for m in ((1, 8) if quick else (1, 2, 4, 8)):
            xs = {k: torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                  for k in {k for _, k, _ in weights.values()}}
            for name, (n, k, ws) in weights.items():
                x, fused = xs[k], name == "gate_up"
                nbytes = n * k * 2
                if fused:
                    t_ref = graph_ms([lambda w=w: silu_mul(F.linear(x, w)) for w in ws]) / len(ws)
                    extra = dict(linear_only_us=1e3 * graph_ms(
                        [lambda w=w: F.linear(x, w) for w in ws]) / len(ws))
                else:
                    t_ref = graph_ms([lambda w=w: F.linear(x, w) for w in ws]) / len(ws)
                    extra = {}
                configs = candidate_configs(m, n // 2 if fused else n, k, fused=fused)
                if extra_m1 and m == 1 and name != "lm_head":
                    more = extra_m1_fused_configs() if fused else extra_m1_configs()
                    configs += [c for c in more if c not in configs]
                for index, cfg in enumerate(configs):
                    if fused:
                        fns = [lambda w=w, c=cfg: gemv_gate_up_silu(x, w, config=c) for w in ws]
                    else:
                        fns = [lambda w=w, c=cfg: gemv(x, w, config=c) for w in ws]
                    try:
                        t = graph_ms(fns) / len(ws)
                    except Exception as exc:  # e.g. out of shared memory: keep the others
                        out.append(dict(kernel="gemv", case=f"{model} {name} M={m} {cfg}",
                                        error=repr(exc)))
                        continue
                    out.append(record(
                        "gemv", f"{model} {name} M={m} {cfg}", t, t_ref, nbytes, bw,
                        model=model, shape=name, m=m, n=n, k=k, config=str(cfg),
                        default=index == 0, triton_us=1e3 * t, cublas_us=1e3 * t_ref,
                        triton_GBps=nbytes / t / 1e6, cublas_GBps=nbytes / t_ref / 1e6, **extra))
            out.append(bench_gemv_step(model, weights, xs, m, bw, hidden, inter, silu_mul, gemv,
                                       gemv_gate_up_silu))
        del weights, xs
        torch.cuda.empty_cache()
    print_gemv(out)
    return out


def bench_gemv_step(model, weights, xs, m, bw, hidden, inter, silu_mul, gemv, gate_up_silu):
    """Every projection of one decode step (layers x qkv, o, gate_up+silu, down; LM head) in
    one graph: the GEMM share of the step, cuBLAS vs gemv's default configs (triton_ms) vs the
    MEASURED hybrid (hybrid_ms)."""
    from generation_service.kernels.gemv import gate_up_silu as hybrid_mlp, linear as hybrid
    layers = len(weights["qkv"][2])
    q_dim = weights["o_proj"][1]
    xh, xq, xi = xs[hidden], xs[q_dim], xs[inter]

    def step_fns(linear, mlp):
        fns = []
        for i in range(layers):
            fns += [lambda i=i: linear(xh, weights["qkv"][2][i]),
                    lambda i=i: linear(xq, weights["o_proj"][2][i]),
                    lambda i=i: mlp(xh, weights["gate_up"][2][i]),
                    lambda i=i: linear(xi, weights["down"][2][i])]
        return fns + [lambda: linear(xh, weights["lm_head"][2][0])]
    t_ref = graph_ms(step_fns(F.linear, lambda x, w: silu_mul(F.linear(x, w))))
    t = graph_ms(step_fns(gemv, gate_up_silu))
    t_hybrid = graph_ms(step_fns(hybrid, hybrid_mlp))
    nbytes = sum(n * k * 2 * (1 if name == "lm_head" else len(ws))
                 for name, (n, k, ws) in weights.items())
    return record("gemv_step", f"{model} M={m} all projections + LM head", t, t_ref, nbytes,
                  bw, model=model, m=m, triton_GBps=nbytes / t / 1e6,
                  cublas_GBps=nbytes / t_ref / 1e6, hybrid_ms=t_hybrid,
                  hybrid_GBps=nbytes / t_hybrid / 1e6)


def decode_step_ms(runner, batch, context, num_row_pages, warmup=10, steps=100) -> float:
    """ms per free decode step (graph replays, host loop included, as benchmarks/decode.py)."""
    from benchmarks._gpu_model import load_rows
    load_rows(runner, batch, context, num_row_pages)
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        runner.step(batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def bench_gemv_decode(bw, quick):
    """The free decode step with cuBLAS (gemv_max_batch=0) vs the gemv.MEASURED hybrid (8):
    Triton GEMVs only for the projections that beat cuBLAS on the H200, per bucket."""
    from benchmarks._gpu_model import pages_per_row, preset_shape, random_kv_cache, random_model
    from benchmarks._gpu_timing import weight_bytes_read
    from generation_service.engine.gpu_runner import GpuDecodeRunner
    context, batches, out = 512, (1, 8) if quick else (1, 2, 4, 8), []
    num_row_pages = pages_per_row(context + 200)
    for preset in ("llama-3.1-8b", "llama-3.2-1b"):
        model = random_model(preset_shape(preset))
        kv = random_kv_cache(model.config, 1 + max(batches) * num_row_pages)
        wbytes = weight_bytes_read(model)  # only B rows of an untied input embedding are read
        runner = GpuDecodeRunner(model, kv, max_batch=max(batches), buckets=batches)
        ms, plans = {}, {}
        with torch.no_grad():
            for gemv_max_batch in (0, max(batches)):
                runner.forward.gemv_max_batch = gemv_max_batch  # read per call: before capture
                if gemv_max_batch:
                    plans = {b: runner.forward.gemv_plan(b) for b in batches}
                runner.capture()
                for batch in batches:
                    ms[gemv_max_batch, batch] = decode_step_ms(runner, batch, context, num_row_pages)
                runner.close()
        for batch in batches:
            t, t_ref = ms[max(batches), batch], ms[0, batch]
            triton = {k: v for k, v in plans[batch].items() if v not in ("cublas", "kernel")}
            out.append(record("gemv_decode", f"{preset} B={batch} free step", t, t_ref, wbytes,
                              bw, cublas_x_floor=t_ref / (wbytes / bw / 1e6),
                              gemv_plan=plans[batch]))
            print(f"{preset} B={batch} free step: cuBLAS {t_ref:.3f} ms, hybrid {t:.3f} ms "
                  f"(x{out[-1]['x_floor']:.2f} weight floor; cuBLAS x{out[-1]['cublas_x_floor']:.2f})"
                  f"; Triton for {triton or 'nothing'}")
        del runner, model, kv
        torch.cuda.empty_cache()
    return out


def print_gemv(records):
    """One line per (model, projection, M): cuBLAS, the default config, the best config."""
    rows = {}
    for rec in records:
        if rec.get("kernel") == "gemv" and "error" not in rec:
            rows.setdefault((rec["model"], rec["shape"], rec["m"]), []).append(rec)
    print(f"{'gemv':<22} {'cublas us':>10} {'GB/s':>6} {'default us':>10} {'GB/s':>6} "
          f"{'best us':>8} {'GB/s':>6}  best config")
    for (model, shape, m), recs in rows.items():
        default = next((r for r in recs if r["default"]), recs[0])
        best = min(recs, key=lambda r: r["triton_us"])
        label = f"{model} {shape} M={m}"
        print(f"{label:<22} {default['cublas_us']:>10.1f} "
              f"{default['cublas_GBps']:>6.0f} {default['triton_us']:>10.1f} "
              f"{default['triton_GBps']:>6.0f} {best['triton_us']:>8.1f} "
              f"{best['triton_GBps']:>6.0f}  {best['config']}")
    for rec in records:
        if rec.get("kernel") == "gemv_step":
            print(f"{rec['case']}: cuBLAS {rec['torch_ms']:.3f} ms ({rec['cublas_GBps']:.0f} GB/s)"
                  f", gemv {rec['triton_ms']:.3f} ms ({rec['triton_GBps']:.0f} GB/s), hybrid "
                  f"{rec['hybrid_ms']:.3f} ms ({rec['hybrid_GBps']:.0f} GB/s)")


def print_table(records):
    cols = ["kernel", "case", "triton_ms", "torch_ms", "speedup", "sdpa_ms", "x_floor",
            "tflops", "probes1_ms", "probes16_ms"]  # full records, probes4_ms too: --out
    print(" | ".join(f"{c:>14}" if i > 1 else f"{c:<22}" for i, c in enumerate(cols)))
    for rec in records:
        cells = []
        for i, c in enumerate(cols):
            val = rec.get(c)
            if isinstance(val, float):
                cells.append(f"{val:>14.4f}")
            else:
                cells.append(f"{'' if val is None else val!s:<22}" if i <= 1 else f"{'':>14}")
        print(" | ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (~1 minute)")
    parser.add_argument("--only", default="", help="comma list: decode,extend,prepare,"
                        "kv_write,mask_sample,norm_rope,tuning,gemv,gemv_decode")
    parser.add_argument("--extra-m1", action="store_true",
                        help="gemv: also time extra_m1_configs() at one row (not in the MEASURED table's candidates)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    started = time.time()
    batches = (1, 32, 128) if args.quick else (1, 8, 32, 64, 128)
    contexts = (512, 8192) if args.quick else (512, 2048, 8192)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s on {torch.cuda.get_device_name()}")
    only = set(filter(None, args.only.split(",")))
    suites = {"decode": lambda: bench_decode(batches, contexts, bw),
              "extend": lambda: bench_extend(bw, args.quick),
              "prepare": lambda: bench_prepare(batches, bw),
              "kv_write": lambda: bench_kv_write(bw),
              "mask_sample": lambda: bench_mask_sample(batches, bw),
              "norm_rope": lambda: bench_norm_rope(bw),
              "tuning": lambda: bench_tuning(bw),
              "gemv": lambda: bench_gemv(bw, args.quick, args.extra_m1),
              "gemv_decode": lambda: bench_gemv_decode(bw, args.quick)}
    records = []
    for name, run in suites.items():
        if (only and name not in only) or (args.quick and name == "tuning" and not only):
            continue
        try:
            records += run()
        except Exception as exc:  # keep the other suites' numbers
            print(f"{name} failed: {exc!r}", file=sys.stderr)
            records.append(dict(kernel=name, error=repr(exc)))
        torch.cuda.empty_cache()
    result = dict(command=" ".join([sys.executable, *sys.argv]),
                  device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, copy_bandwidth_GBps=bw,
                  seconds=time.time() - started, results=records)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_table([r for r in records if "error" not in r])
    return 0


if __name__ == "__main__":
    sys.exit(main())
