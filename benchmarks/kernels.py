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
The GEMV suites are in _kernels_gemv.py; how a kernel is timed and recorded, _kernel_timing.py.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._harness import VOCAB, write_result  # noqa: E402
from benchmarks._kernel_timing import DEV, bench, copy_bandwidth, record  # noqa: E402
from benchmarks._kernels_gemv import bench_gemv, bench_gemv_decode  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16


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
    write_result(args.out, result)
    print_table([r for r in records if "error" not in r])
    return 0


if __name__ == "__main__":
    sys.exit(main())
