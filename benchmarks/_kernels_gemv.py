"""kernels.py's GEMV suites (`--only gemv`, `--only gemv_decode`; its docstring says what each
times): the decode projections, cuBLAS against every candidate config of kernels/gemv.py, every
projection of a step in one graph, and the whole free decode step with and without the GEMVs.
Assumes kernels.py has put the repository root on sys.path.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from benchmarks._harness import VOCAB
from benchmarks._kernel_timing import DEV, graph_ms, record

GEMV_MODELS = {  # model: (hidden, intermediate, q heads x head_dim, kv heads x head_dim, layers)
    "8B": (4096, 14336, 32 * 128, 8 * 128, 32),
    "1B": (2048, 8192, 32 * 64, 8 * 64, 16),
}


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
