"""The roofline side of benchmarks/serve.py, measured on the GPU in its own process (it exits,
freeing the device, before the server starts):

- the bf16 matmul rate (an 8192^3 product on random data, median of 10) and the device copy
  bandwidth: the ceilings prefill is held to;
- the decode graph's step time per batch and context: the free decode graph of the serving
  runner (`GpuDecodeRunner`, the buckets the server captures) over a KV cache of random values
  with every row at that context, median replay time;
- with --tensor-parallel N > 1, no decode-graph steps (that runner is single-GPU) but the
  per-GPU weight-read floor of a decode step: the weights' bytes / N at the copy bandwidth;
- with --mixed-points, the captured mixed step (`MixedGraphs`, the graphs the server replays for a
  step that holds a prompt chunk) of D decode rows at context C beside one P-token chunk: the
  replay alone on the GPU, and the whole call from the host (pack, upload, replay), unoverlapped;
  with --mixed-kernels, also each replay's kernels by group (torch.profiler) and its GEMMs'
  time and TFLOP/s by projection; with --mixed-buckets, graphs of those token buckets;
- the model's FLOPs per prompt: 2 x the linear parameters per token, the causal attention's
  4 x layers x heads x head_dim x (n^2 / 2), and one LM-head row;
- with --quantization fp8 and/or --kv-cache-dtype fp8 (the server's flags), every step above is
  timed on what that server runs: the model's linear layers quantized at load as the loader does
  (`quantize_model_`, per-channel e4m3), KV pages in e4m3. With --quantization fp8 the prefill
  ceiling `matmul_tflops` is the FP8 rate (`torch._scaled_mm`, row-wise scales, the GEMM of
  `kernels/fp8_gemm.py`; the bf16 one beside it), and the weight-read floor counts the bytes that
  model's decode step reads (FP8 linear weights and their scales, the bf16 LM head and norms).

    python benchmarks/_roofline.py --config folder/config.json --points 1:1024 64:576 --out r.json
    python benchmarks/_roofline.py --config folder/config.json --points 128:576 --mixed-points 96:576:448 --out r.json
    python benchmarks/_roofline.py --config folder/config.json --points 1:1024 --tensor-parallel 4 --out r.json
    python benchmarks/_roofline.py --config folder/config.json --points 1:576 64:576 --quantization fp8 \
        --kv-cache-dtype fp8 --out r.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._gpu_timing import median_ms, weight_bytes_read  # noqa: E402


def prefill_flops(config, num_tokens: int) -> float:
    """FLOPs of one prompt of `num_tokens` tokens (linear layers, causal attention, one LM-head row)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    linear = 2.0 * num_tokens * per_layer * c.num_layers
    attention = 4.0 * c.num_layers * c.num_heads * c.head_dim * num_tokens * (num_tokens + 1) / 2
    return linear + attention + 2.0 * c.hidden_size * c.vocab_size


def ceilings(quantization: str | None = None) -> dict:
    """The matmul rate prefill is held to (bf16; with quantization "fp8" the FP8 GEMM's, the
    bf16 one beside it) and the device copy bandwidth (bytes read + written per second)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul_ms = median_ms(lambda: a @ b, 10)
    out = {"matmul_tflops": 2 * 8192 ** 3 / matmul_ms / 1e9}
    if quantization == "fp8":  # e4m3 operands, one fp32 scale per row of each, bf16 out
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        scale_a = torch.ones(8192, 1, device="cuda", dtype=torch.float32)
        scale_b = torch.ones(1, 8192, device="cuda", dtype=torch.float32)
        fp8_ms = median_ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=scale_a, scale_b=scale_b,
                                                    out_dtype=torch.bfloat16), 10)
        out = {"matmul_tflops": 2 * 8192 ** 3 / fp8_ms / 1e9, "bf16_matmul_tflops": out["matmul_tflops"]}
        del a8, b8
    src = torch.randn(1 << 31, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), 10)
    del a, b, src, dst
    torch.cuda.empty_cache()
    return out | {"copy_bandwidth_GBps": 2 * (2 << 31) / copy_ms / 1e6}


@torch.no_grad()
def decode_steps(model, points: list[tuple[int, int]], kv_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Free decode-graph step time of each (batch, context) of `model` (`random_model`), KV pages in `kv_dtype`."""
    from benchmarks._gpu_model import load_rows, pages_per_row, random_kv_cache
    from generation_service.engine.cuda_graphs import FREE
    from generation_service.engine.gpu_runner import GpuDecodeRunner

    config = model.config
    batches = sorted({b for b, _ in points})
    max_batch, reps = max(batches), 20
    row_pages = [pages_per_row(c + reps + 8) for _, c in points]
    num_pages = max(b * n for (b, _), n in zip(points, row_pages))  # one point at a time
    kv = random_kv_cache(config, 1 + num_pages, kv_dtype)
    runner = GpuDecodeRunner(model, kv, max_batch=max_batch, buckets=tuple(batches), variants=(FREE,))
    runner.capture()
    rows = []
    for (batch, context), per_row in sorted(zip(points, row_pages)):
        load_rows(runner, batch, context, per_row, config.vocab_size)
        ms = median_ms(lambda: runner.step(batch), reps)
        rows.append({"batch": batch, "context": context, "step_ms": ms})
        print(f"decode graph b={batch:3d} ctx={context:5d}: {ms:.3f} ms", flush=True)
    runner.close()
    return rows


@torch.no_grad()
def mixed_steps(model, points: list[tuple[int, int, int]], max_rows: int, kernels: bool = False,
                buckets: tuple[int, ...] | None = None, kv_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Mixed-step graph time of each (decode rows, context, prompt chunk): D rows of one new token
    at context C, then a first chunk of P prompt tokens, sampled at its end; graphs of `max_rows`
    rows (the server's max batch; at least D + 1); `kernels`: and the replay's kernels."""
    from types import SimpleNamespace

    from benchmarks._gpu_model import pages_per_row, random_kv_cache
    from generation_service.engine.cuda_graphs import FREE
    from generation_service.engine.gpu_runner import GpuDecodeRunner
    from generation_service.engine.mixed_graphs import MIXED_TOKEN_BUCKETS, MixedGraphs
    from generation_service.engine.scheduler import ScheduledRow

    config = model.config
    max_pages = max(pages_per_row(max(c, p) + 1) for _, c, p in points)
    kv = random_kv_cache(config, 1 + max(d * pages_per_row(c + 1) + pages_per_row(p) for d, c, p in points), kv_dtype)
    runner = GpuDecodeRunner(model, kv, max_batch=max_rows, buckets=(max_rows,), variants=(FREE,))
    graphs = MixedGraphs(runner.forward, runner.max_batch, max_pages, buckets=buckets or MIXED_TOKEN_BUCKETS)
    graphs.capture()
    ids = torch.Generator().manual_seed(0)

    def row(first_page: int, cached: int, new: int) -> ScheduledRow:
        pages = list(range(first_page, first_page + pages_per_row(cached + new)))
        tokens = torch.randint(0, config.vocab_size, (new,), generator=ids).tolist()
        return ScheduledRow(SimpleNamespace(pages=pages), cached, tokens, is_sampling=True)

    results = []
    for decode, context, prefill in points:
        per_row = pages_per_row(context + 1)  # page 0 is the padding's dummy page
        rows = [row(1 + i * per_row, context, 1) for i in range(decode)] + [row(1 + decode * per_row, 0, prefill)]
        bucket = graphs.token_bucket(decode + prefill)
        graphs(rows)  # the inputs of that step in the graphs' buffers
        gpu_ms = median_ms(lambda: graphs.graphs.replay(bucket, FREE), 20)
        call_ms = median_ms(lambda: graphs(rows), 20)
        results.append({"decode_rows": decode, "context": context, "prefill_tokens": prefill, "bucket": bucket,
                        "replay_ms": gpu_ms, "call_ms": call_ms})
        print(f"mixed graph d={decode:3d} ctx={context:5d} prefill={prefill:5d} (bucket {bucket}): replay "
              f"{gpu_ms:.3f} ms, pack + upload + replay {call_ms:.3f} ms", flush=True)
        if kernels:
            results[-1]["kernels"] = replay_kernels(model, lambda: graphs.graphs.replay(bucket, FREE), bucket,
                                                    min(max_rows, bucket))
    graphs.close()
    runner.close()
    return results


def replay_kernels(model, replay, num_tokens: int, num_logits: int, reps: int = 10) -> dict:
    """The kernels of `reps` replays of a mixed graph of `num_tokens` slots (`num_logits` LM-head
    rows) by group, and its GEMMs by projection: mean time and TFLOP/s at those rows."""
    from benchmarks._kernel_profile import profile_kernels, projection_bytes, projection_times, summarize
    found = profile_kernels(replay, reps, None)
    summary = summarize(found, reps)
    times = projection_times(found, model.config.num_layers)
    if times is not None:
        summary["projections"] = {}
        for name, nbytes in projection_bytes(model).items():
            ts = times[name][:len(times[name]) - 1] if name == "down" else times[name]  # the last: L rows
            rows = num_logits if name == "lm_head" else num_tokens
            mean_us = sum(ts) / len(ts)
            summary["projections"][name] = {"mean_us": mean_us, "rows": rows,
                                            "tflops": 2 * rows * (nbytes // 2) / (mean_us * 1e-6) / 1e12}
    print("  kernels/replay %.0f, %.3f ms: %s" % (summary["kernels_per_step"], summary["kernel_ms"], ", ".join(
        f"{g} {v['total_us']:.0f} us" for g, v in summary["groups"].items())), flush=True)
    for name, p in summary.get("projections", {}).items():
        print(f"  {name:8s} {p['mean_us']:7.1f} us at {p['rows']} rows: {p['tflops']:.0f} TFLOP/s", flush=True)
    return summary


def main() -> int:
    from generation_service.model.loader import read_config
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the served model's config.json")
    parser.add_argument("--points", nargs="+", required=True, help="BATCH:CONTEXT pairs to time")
    parser.add_argument("--mixed-points", nargs="*", default=[], help="DECODE_ROWS:CONTEXT:PROMPT_CHUNK triples to time")
    parser.add_argument("--max-batch", type=int, default=0, help="the mixed graphs' rows (default: the most a point needs)")
    parser.add_argument("--mixed-kernels", action="store_true", help="profile each mixed point's replay (kernels by group)")
    parser.add_argument("--mixed-buckets", type=int, nargs="*", default=None,
                        help="the mixed graphs' token buckets (default: the server's, MIXED_TOKEN_BUCKETS)")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--quantization", choices=("fp8",), default=None,
                        help="the server's --quantization: the linear layers in FP8 e4m3 (one GPU only)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the server's --kv-cache-dtype: fp8, KV pages in e4m3 (one GPU only)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    n = args.tensor_parallel
    if n > 1 and (args.quantization or args.kv_cache_dtype != "auto"):
        parser.error("FP8 runs on one GPU only (the server's rule)")
    config = read_config(pathlib.Path(args.config))
    result = ceilings(args.quantization)
    print(f"{args.quantization or 'bf16'} matmul {result['matmul_tflops']:.0f} TFLOP/s, "
          f"copy {result['copy_bandwidth_GBps']:.0f} GB/s", flush=True)
    points = sorted({tuple(int(x) for x in point.split(":")) for point in args.points})
    result.update(tensor_parallel=n, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                  decode_steps=[])
    model = None
    if n == 1:  # one random model for both kinds of step, quantized as the loader does
        from benchmarks._gpu_model import random_model
        model = random_model(config)
        if args.quantization:
            from generation_service.model.quantization.apply import quantize_model_
            from generation_service.model.quantization.scheme import ONLINE_FP8
            quantize_model_(model, ONLINE_FP8)
            torch.cuda.empty_cache()
        result["weight_bytes_per_gpu"] = weight_bytes_read(model)
    else:
        embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size  # one row is read
        result["weight_bytes_per_gpu"] = (config.num_parameters - embedding) * 2 / n  # bf16
    result["weight_read_floor_ms"] = result["weight_bytes_per_gpu"] / (result["copy_bandwidth_GBps"] * 1e9) * 1e3
    print(f"weight-read floor per GPU at TP={n}: {result['weight_read_floor_ms']:.3f} ms "
          f"({result['weight_bytes_per_gpu'] / 1e9:.2f} GB)", flush=True)
    if model is not None:
        from generation_service.engine.kv_cache import kv_cache_dtype
        kv_dtype = kv_cache_dtype(args.kv_cache_dtype, torch.bfloat16)
        result["decode_steps"] = decode_steps(model, points, kv_dtype)
        mixed = sorted({tuple(int(x) for x in point.split(":")) for point in args.mixed_points})
        if mixed:
            torch.cuda.empty_cache()
            result["mixed_steps"] = mixed_steps(model, mixed, args.max_batch or 1 + max(d for d, _, _ in mixed),
                                                args.mixed_kernels,
                                                tuple(args.mixed_buckets) if args.mixed_buckets else None, kv_dtype)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
