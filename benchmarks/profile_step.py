"""Where the decode step's time goes: kernels, groups, gaps (device script, one GPU).

    python3 benchmarks/profile_step.py --out $OUT/profile-h200.json

Per model shape (random weights, bf16, vocab 131072 as in benchmarks/decode.py) and batch
(1 and 32, `--context` 512 cached tokens per row), over the `free` decode graph (forward +
mask_sample greedy, no channel work):
- step_ms: CUDA events around each of `--steps` replays (median; mean too), as decode.py's
  free column (which divides wall time by steps);
- kernels, from torch.profiler (CUPTI) over `--profile-steps` replays: kernel_ms per step
  (sum of kernel durations; one stream, so no overlap) and gap_ms = step_ms - kernel_ms
  (launch gaps between graph nodes, the tail); per group (GEMM, attention, add_rmsnorm,
  rope_write_kv, silu_mul, mask_sample, embedding, other elementwise): count, total and
  mean us per step; the top kernel names;
- projections: each GEMM's achieved weight-read GB/s (weight bytes / kernel time) for
  qkv, o, gate_up, down and the LM head, from the profile (GEMMs in graph order, 4 per
  layer then the LM head; Triton gemv kernels count as GEMMs) and from each projection's
  cuBLAS GEMMs alone in a graph ("isolated");
- floor: weights read per step / device copy bandwidth measured here (decode.py's floor).
If the profiler reports no kernels inside graph replays, the eager step body
(`GpuDecodeRunner.body`) is profiled instead: `kernel_source` says which.
Variants with a `graph` (nowait, prepublished) replay that channel variant instead of the free
one, over a mapped step channel whose masks allow every token (the side stream's kernels
count too: kernel_ms may then exceed step_ms).
`--variants` profiles several DecodeForward settings over the same model and cache, side by
side (VARIANTS: the GEMV table on or off, programmatic dependent launch on or off, the fused
prologue and step epilogue or the torch ops they replace, the RMSNorms folded into the GEMVs or
kernels; "embedding" counts the prologue).
Reading and summing the profiler's kernels is _kernel_profile.py.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._gpu_model import (  # noqa: E402
    load_rows, pages_per_row, preset_shape, projection_inputs, random_kv_cache, random_model,
)
# the decode table's floor, computed the same way
from benchmarks._gpu_timing import copy_bandwidth_gbs, event_times_ms, graph_ms, weight_bytes_read  # noqa: E402
from benchmarks._harness import VOCAB, log, write_result  # noqa: E402
from benchmarks._kernel_profile import (  # noqa: E402
    gbs_table, profile_kernels, projection_bytes, projection_times, summarize,
)

# DecodeForward / GpuDecodeRunner settings (set before capture) and pdl (kernels/pdl.py's
# switch, read per launch: on for every kernel launched while capturing the variant's graphs)
VARIANTS = {
    "cublas": dict(gemv_max_batch=0, pdl=False),
    "gemv": dict(gemv_max_batch=8, pdl=False),
    "gemv+pdl": dict(gemv_max_batch=8, pdl=True),  # with gemv.PDL_M1 at one row
    # the same with the ~15 torch ops before layer 0 that kernels/decode_prologue.py replaces
    "gemv+pdl-torch-prologue": dict(gemv_max_batch=8, pdl=True, fused_prologue=False),
    # ... and the 5 torch ops after sampling that kernels/step_epilogue.py replaces (GpuDecodeRunner)
    "gemv+pdl-torch-epilogue": dict(gemv_max_batch=8, pdl=True, fused_epilogue=False),
    # every RMSNorm a kernel (weightless, the same folded weights): what folding the norms into
    # the GEMVs around them saves (DecodeForward.fold_norms; gemv_plan's *_norm entries)
    "gemv+pdl-unfolded-norms": dict(gemv_max_batch=8, pdl=True, fold_norms=False),
    # gemv.PDL_M1 as it was before the BLOCK_N 8 CUDA-core configs (kernels-gemv-m1-h200.json):
    # qkv and down only, o_proj from MEASURED (set while this variant captures)
    "gemv+pdl-m1-before": dict(gemv_max_batch=8, pdl=True, pdl_m1={
        "6144x4096": "row n16 k512 w4 s3", "4096x14336": "dot n32 k256 w4 s4",
        "3072x2048": "row n16 k512 w4 s3", "2048x8192": "dot n16 k512 w4 s3"}),
    # the step channel's graph variants (graph: which one; default free) over a real mapped
    # region whose masks are all ones: nowait (publish inputs, gather masks, write outputs, no
    # wait) and prepublished (the serving body, its wait always passing): what a constrained
    # step costs the GPU beyond free when grammar_service is never late
    "gemv+pdl/nowait": dict(gemv_max_batch=8, pdl=True, graph="nowait"),
    "gemv+pdl/prepublished": dict(gemv_max_batch=8, pdl=True, graph="prepublished"),
    # ... with the step's tail as before kernels/step_epilogue.py published outputs_seq itself:
    # a write memop and 3 kernels after the epilogue (GpuDecodeRunner.fold_step_tail)
    "gemv+pdl/prepublished-unfolded-tail": dict(gemv_max_batch=8, pdl=True, graph="prepublished",
                                                fold_step_tail=False),
    # ... with inputs_seq published as before the prologue kernel did it: a write memop and a
    # copy kernel ahead of the forward (GpuDecodeRunner.fold_inputs_seq)
    "gemv+pdl/prepublished-unfolded-inputs": dict(gemv_max_batch=8, pdl=True, graph="prepublished",
                                                  fold_inputs_seq=False),
    # ... below 16 rows, mask_sample reading the mapped ring in place, no gather kernel
    "gemv+pdl/prepublished-ring-read": dict(gemv_max_batch=8, pdl=True, graph="prepublished",
                                            ring_mask_read=True),
    # below 16 rows, the mask wait + gather forked beside the LM head instead of after it
    "gemv+pdl/prepublished-at-head": dict(gemv_max_batch=8, pdl=True, graph="prepublished", prefetch_at_head=True),
    "gemv+pdl/nowait-at-head": dict(gemv_max_batch=8, pdl=True, graph="nowait", prefetch_at_head=True),
    # the side stream's mask gather (>= 16 rows) by torch.index_select, as before
    # kernels/mask_gather.py, or by that kernel over fewer or more CTAs than the default
    "gemv+pdl/nowait-index-select": dict(gemv_max_batch=8, pdl=True, graph="nowait", mask_gather_programs=0),
    **{f"gemv+pdl/nowait-gather-{n}": dict(gemv_max_batch=8, pdl=True, graph="nowait", mask_gather_programs=n)
       for n in (2, 4, 16, 32)},
}
def isolated_projections(model, runner, bucket: int, reps: int = 20) -> dict[str, list[float]]:
    """Each projection's GEMMs over every layer (distinct weights: no L2 reuse) alone in one
    graph; per-GEMM us = graph time / layers (includes the graph's node-to-node gaps)."""
    import torch.nn.functional as F
    x, xq, xi = projection_inputs(model.config, bucket)
    pairs = list(zip(runner.forward.weights, model.model.layers))
    chains = {"qkv": lambda: [F.linear(x, w.qkv) for w, _ in pairs],
              "o": lambda: [F.linear(xq, layer.self_attn.o_proj.weight) for _, layer in pairs],
              "gate_up": lambda: [F.linear(x, w.gate_up) for w, _ in pairs],
              "down": lambda: [F.linear(xi, layer.mlp.down_proj.weight) for _, layer in pairs],
              "lm_head": lambda: F.linear(x, model.output_weight)}
    out = {}
    for name, chain in chains.items():
        per_graph_us = graph_ms(chain, reps) * 1e3
        calls = 1 if name == "lm_head" else len(pairs)
        out[name] = [per_graph_us / calls] * calls
    return out


def all_ones_channel(max_batch: int):
    """(channel, mapped): a step channel registered with CUDA whose masks allow every token."""
    from step_channel import Geometry, StepChannel
    from step_channel.cuda import MappedChannel
    channel = StepChannel.create(Geometry(max_batch=max_batch, max_positions=1, vocab_size=VOCAB, depth=4))
    for k in range(channel.geometry.depth):
        channel.entry(k).masks[:] = -1
    return channel, MappedChannel.register(channel)


def profile_batch(args, model, runner, batch: int, num_row_pages: int, trace_dir,
                  isolated: bool = True, variant=None) -> dict:
    """variant: the graph variant replayed (default the free one)."""
    from generation_service.engine.cuda_graphs import FREE
    variant = variant or FREE
    cfg = model.config
    load_rows(runner, batch, args.context, num_row_pages)
    for _ in range(args.warmup):
        runner.step(batch, variant=variant)
    load_rows(runner, batch, args.context, num_row_pages)
    times = event_times_ms(lambda: runner.step(batch, variant=variant), args.steps)
    step_ms = sorted(times)[len(times) // 2]
    load_rows(runner, batch, args.context, num_row_pages)
    if trace_dir:
        trace_dir.mkdir(parents=True, exist_ok=True)
    trace = str(trace_dir / f"{cfg.num_layers}L-b{batch}.json") if trace_dir else None
    kernels, source = [], "graph replay"
    if not args.eager:
        kernels = profile_kernels(lambda: runner.step(batch, variant=variant), args.profile_steps, trace)
    if len(kernels) < 2 * cfg.num_layers * args.profile_steps:  # none seen inside the graphs
        log(f"b={batch}: {len(kernels)} kernels seen in graph replays: profiling the eager body")
        source = "eager body (GpuDecodeRunner.body, free variant)"
        load_rows(runner, batch, args.context, num_row_pages)
        with torch.no_grad():
            kernels = profile_kernels(lambda: runner.body(batch, FREE), args.profile_steps, trace)
    out = {"batch": batch, "context": args.context, "step_ms": step_ms,
           "step_ms_mean": sum(times) / len(times), "kernel_source": source}
    out.update(summarize(kernels, args.profile_steps))
    out["gap_ms"] = step_ms - out["kernel_ms"]
    nbytes = projection_bytes(model)
    by_projection = projection_times(kernels, cfg.num_layers)
    out["projections"] = gbs_table(by_projection, nbytes) if by_projection else None
    if isolated:  # cuBLAS alone: the same for every variant
        out["projections_isolated"] = gbs_table(isolated_projections(model, runner, batch), nbytes)
    return out


def parse_pdl_m1(table: dict[str, str]) -> dict:
    """{"NxK": "row n16 k512 w4 s3", ...} (a VARIANTS pdl_m1) -> gemv.PDL_M1's form."""
    from generation_service.kernels.gemv import GemvConfig
    out = {}
    for shape, text in table.items():
        kind, *fields = text.split()
        n, k, w, s = (int(f[1:]) for f in fields)
        out[tuple(map(int, shape.split("x"))) + (False,)] = GemvConfig(n, k, w, s, use_dot=kind == "dot")
    return out


def model_shape(args, preset: str, bandwidth: float) -> dict:
    from generation_service.engine.cuda_graphs import FREE, NOWAIT, PREPUBLISHED
    from generation_service.engine.gpu_runner import GpuDecodeRunner
    from generation_service.kernels import gemv, pdl
    pdl_m1_table = dict(gemv.PDL_M1)  # a variant's pdl_m1 replaces it while it captures
    graph_variants = {"free": FREE, "nowait": NOWAIT, "prepublished": PREPUBLISHED}
    started = time.perf_counter()
    model = random_model(preset_shape(preset))
    max_batch = max(args.batches)
    num_row_pages = pages_per_row(args.context + args.warmup + args.steps + args.profile_steps + 8)
    kv = random_kv_cache(model.config, 1 + max_batch * num_row_pages)
    trace_dir = pathlib.Path(args.trace_dir) / preset if args.trace_dir else None
    if trace_dir:
        trace_dir.mkdir(parents=True, exist_ok=True)
    floor_ms = weight_bytes_read(model) / (bandwidth * 1e9) * 1e3
    out = {"preset": preset, "weight_bytes_read": weight_bytes_read(model),
           "weight_floor_ms": floor_ms, "variants": []}
    for index, name in enumerate(args.variants):
        settings = dict(VARIANTS[name])
        pdl.ENABLED = settings.pop("pdl")
        pdl_m1 = settings.pop("pdl_m1", None)
        gemv.PDL_M1.clear()
        gemv.PDL_M1.update(pdl_m1_table if pdl_m1 is None else parse_pdl_m1(pdl_m1))
        graph = graph_variants[settings.pop("graph", "free")]
        channel = mapped = None
        if graph.uses_channel:
            channel, mapped = all_ones_channel(max_batch)
        runner = GpuDecodeRunner(model, kv, max_batch=max_batch, buckets=tuple(args.batches),
                                 mapped=mapped, variants=tuple(dict.fromkeys((FREE, graph))))
        if mapped is not None:
            runner.set_channel_step(1)
        for key, value in settings.items():  # read per call or at capture: set before capture
            setattr(runner if hasattr(runner, key) else runner.forward, key, value)
        with torch.no_grad():
            capture_s = runner.capture()
            log(f"{preset} [{name}]: built and captured in {time.perf_counter() - started:.1f} s")
            rows = []
            for batch in args.batches:
                row = profile_batch(args, model, runner, batch, num_row_pages,
                                    trace_dir and trace_dir / name.replace("/", "-"),
                                    isolated=index == 0, variant=graph)
                row["over_weight_floor"] = row["step_ms"] / floor_ms
                row["gemv_plan"] = runner.forward.gemv_plan(batch)
                rows.append(row)
                print_row(f"{preset} [{name}]", row)
        out["sampler"] = runner.sampler
        out["variants"].append({"variant": name, **VARIANTS[name], "capture_s": capture_s, "rows": rows})
        runner.close()
        del runner
        if channel is not None:  # graphs -> unregister -> unmap
            mapped.close()
            channel.close()
        started = time.perf_counter()
    gemv.PDL_M1.clear()
    gemv.PDL_M1.update(pdl_m1_table)
    del model, kv
    torch.cuda.empty_cache()
    return out


def print_row(preset: str, row: dict) -> None:
    log(f"{preset} b={row['batch']}: step {row['step_ms']:.3f} ms (x{row['over_weight_floor']:.2f} "
        f"floor), kernels {row['kernel_ms']:.3f} ms in {row['kernels_per_step']:.0f}, gaps "
        f"{row['gap_ms']:.3f} ms [{row['kernel_source']}]")
    for name, g in row["groups"].items():
        print(f"    {name:18s} {g['count']:6.0f} x {g['mean_us']:8.2f} us = {g['total_us']:9.1f} us")
    for label in ("projections", "projections_isolated"):
        for name, p in (row.get(label) or {}).items():
            print(f"    {label:20s} {name:8s} {p['mean_us']:8.2f} us  {p['gbs']:7.0f} GB/s")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["llama-3.1-8b", "llama-3.2-1b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--context", type=int, default=512, help="cached tokens per row")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50, help="timed replays (CUDA events)")
    ap.add_argument("--profile-steps", type=int, default=5, help="replays under the profiler")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["cublas", "gemv", "gemv+pdl"],
                    help="DecodeForward settings to profile side by side (VARIANTS)")
    ap.add_argument("--eager", action="store_true", help="profile the eager step body only")
    ap.add_argument("--trace-dir", help="keep the chrome traces here")
    ap.add_argument("--out", help="write the JSON here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_step.py needs a CUDA device", file=sys.stderr)
        return 2
    started = time.perf_counter()
    bandwidth = copy_bandwidth_gbs()
    log(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth:.0f} GB/s")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "copy_bandwidth_GBps": bandwidth, "models": []}
    for preset in args.presets:
        result["models"].append(model_shape(args, preset, bandwidth))
    result["wall_s"] = time.perf_counter() - started
    log(f"done in {result['wall_s']:.0f} s")
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
