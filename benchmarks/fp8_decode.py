"""FP8 decode on the GPU (issue 47 point 3): the free decode graph step of a random-weight shape in
BF16 and then FP8 (`--quantization fp8` applied to the same weights; FP8 KV pages with
`--fp8-kv`), in one process, each over its weight-read floor (weights read once a step + the
rows' K/V at the context, over the measured copy bandwidth); and each projection alone, BF16
cuBLAS against the FP8 GEMV (M <= 16) or torch._scaled_mm, over its own floor.

    python benchmarks/fp8_decode.py --preset llama-3.1-8b --batches 1 8 64 --out $OUT/fp8_decode.json
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._gpu_model import load_rows, pages_per_row, preset_shape, random_model  # noqa: E402
from benchmarks._gpu_timing import copy_bandwidth_gbs, graph_ms, weight_bytes_read  # noqa: E402
from benchmarks._harness import code_commit, command_line, log, write_result  # noqa: E402
from generation_service.engine.cuda_graphs import FREE  # noqa: E402
from generation_service.engine.gpu_runner import GpuDecodeRunner  # noqa: E402
from generation_service.engine.kv_cache import KV_FP8, KVCache  # noqa: E402
from generation_service.model.quantization.apply import quantize_model_  # noqa: E402
from generation_service.model.quantization.scheme import ONLINE_FP8  # noqa: E402


def kv_cache(cfg, num_pages: int, dtype: torch.dtype) -> KVCache:
    kv = KVCache(cfg.num_layers, num_pages, 16, cfg.num_kv_heads, cfg.head_dim, dtype, "cuda")
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, device="cuda").to(dtype))
    return kv


def time_steps(model, kv, args, num_row_pages: int) -> dict[int, float]:
    """ms per free decode graph step, per batch."""
    runner = GpuDecodeRunner(model, kv, max_batch=max(args.batches), buckets=tuple(args.batches), variants=(FREE,))
    with torch.no_grad():
        runner.capture()
        out = {}
        for batch in args.batches:
            load_rows(runner, batch, args.context, num_row_pages)
            for _ in range(args.warmup):
                runner.step(batch, wait=False)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                runner.step(batch, wait=False)
            torch.cuda.synchronize()
            out[batch] = (time.perf_counter() - start) / args.steps * 1e3
    runner.close()
    return out


def projections(model) -> dict[str, torch.nn.Module]:
    layer = model.model.layers[0]
    return {"q_proj": layer.self_attn.q_proj, "o_proj": layer.self_attn.o_proj,
            "gate_proj": layer.mlp.gate_proj, "down_proj": layer.mlp.down_proj}


def time_projections(model, rows_list, bandwidth) -> list[dict]:
    """Each projection alone, one graph of `reps` calls over distinct inputs: ms and x floor."""
    from generation_service.engine.decode_forward import projection_weight
    from generation_service.kernels import gemv
    from generation_service.kernels.fp8_gemm import fp8_linear
    out = []
    for name, layer in projections(model).items():
        weight = projection_weight(layer)
        is_fp8 = not isinstance(weight, torch.Tensor)
        nbytes = layer.weight.numel() * layer.weight.element_size()
        for rows in rows_list:
            x = torch.randn(rows, layer.in_features, device="cuda", dtype=torch.bfloat16)
            if is_fp8:
                fn = (lambda: gemv.linear(x, weight)) if rows <= 16 else (lambda: fp8_linear(x, weight))
            else:
                fn = lambda: F.linear(x, weight)  # noqa: E731
            ms = graph_ms(fn)
            floor = nbytes / (bandwidth * 1e9) * 1e3  # the weight read at the copy rate
            out.append({"projection": name, "rows": rows, "fp8": is_fp8, "us": ms * 1e3,
                        "x_floor": ms / floor, "kernel": ("gemv" if rows <= 16 else "scaled_mm") if is_fp8 else "cublas"})
            log(f"  {name} rows {rows} {'fp8' if is_fp8 else 'bf16'}: {ms * 1e3:.1f} us ({ms / floor:.2f}x floor)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--proj-rows", nargs="+", type=int, default=[1, 8, 512])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    bandwidth = copy_bandwidth_gbs()  # bytes read + written per second: docs/gpu.md's floors use it for reads
    cfg = preset_shape(args.preset)
    num_row_pages = pages_per_row(args.context + args.warmup + args.steps + 8)
    num_pages = 1 + max(args.batches) * num_row_pages
    model = random_model(cfg)
    result = {"preset": args.preset, "copy_gbs": bandwidth, "context": args.context, "rows": []}
    runs = {}
    for label in ("bf16", "fp8", "fp8+fp8kv"):
        if label == "fp8":
            result["projections_bf16"] = time_projections(model, args.proj_rows, bandwidth)
            quantize_model_(model, ONLINE_FP8)
            torch.cuda.empty_cache()
            result["projections_fp8"] = time_projections(model, args.proj_rows, bandwidth)
        kv_dtype = KV_FP8 if label.endswith("fp8kv") else torch.bfloat16
        kv = kv_cache(cfg, num_pages, kv_dtype)
        log(f"{args.preset} {label}: capturing")
        runs[label] = time_steps(model, kv, args, num_row_pages)
        wbytes = weight_bytes_read(model)
        kv_token = KVCache.bytes_per_page(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        for batch, ms in runs[label].items():
            floor_ms = (wbytes + batch * (args.context + 1) * kv_token) / (bandwidth * 1e9) * 1e3
            row = {"variant": label, "batch": batch, "ms_per_step": ms, "tokens_per_s": batch / ms * 1e3,
                   "floor_ms": floor_ms, "x_floor": ms / floor_ms, "weight_bytes": wbytes}
            result["rows"].append(row)
            log(f"{label} b={batch}: {ms:.3f} ms/step, {row['tokens_per_s']:.0f} tok/s, "
                f"floor {floor_ms:.3f} ms (x{row['x_floor']:.2f})")
        del kv
        torch.cuda.empty_cache()
    for batch in args.batches:
        log(f"b={batch}: fp8 / bf16 step x{runs['bf16'][batch] / runs['fp8'][batch]:.2f} faster, "
            f"fp8+fp8kv x{runs['bf16'][batch] / runs['fp8+fp8kv'][batch]:.2f}")
    result.update(command=command_line("benchmarks/fp8_decode.py"), code_commit=code_commit(),
                  device=torch.cuda.get_device_name())
    write_result(args.out, result, indent=2)


if __name__ == "__main__":
    main()
