"""profile_step.py's view of decode steps through torch.profiler (CUPTI): `profile_kernels` reads
the device activity of some calls from the profiler's chrome trace; the rest is pure (testable
without a GPU): kernels by group, per-step totals and the top names (`summarize`), the GEMMs by
projection in launch order (`projection_times`) and their weight-read GB/s (`projection_bytes`,
`gbs_table`).
"""
from __future__ import annotations

import json
import os
import tempfile

import torch

PROJECTIONS = ("qkv", "o", "gate_up", "down")
# (group, lower-case substrings of kernel names), first match wins: Triton kernels by their
# function names first (attention's reduce kernel must not fall into GEMM's split-K reduce).
GROUPS = (
    ("add_rmsnorm", ("_rmsnorm_kernel",)),
    ("rope_write_kv", ("_rope_kernel",)),
    ("silu_mul", ("_silu_mul_kernel",)),
    ("attention", ("_decode_split_kernel", "_decode_reduce_kernel", "attention", "flash")),
    ("mask_sample", ("_partial_kernel", "_finalize_kernel")),
    ("embedding", ("embedding", "_prologue_kernel")),
    ("index_select", ("indexselect",)),  # the torch embedding gather, or the channel's mask gather
    ("gemm", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitkreduce")),
)


def group_of(name: str) -> str:
    lower = name.lower()
    for group, keys in GROUPS:
        if any(key in lower for key in keys):
            return group
    return "other_elementwise"


def summarize(kernels: list[dict], num_steps: int) -> dict:
    """kernels: {name, dur (us)} of num_steps replays -> per-step totals, groups, top names."""
    groups: dict[str, dict] = {}
    names: dict[str, float] = {}
    for k in kernels:
        g = groups.setdefault(group_of(k["name"]), {"count": 0, "total_us": 0.0})
        g["count"] += 1
        g["total_us"] += k["dur"]
        names[k["name"]] = names.get(k["name"], 0.0) + k["dur"]
    for g in groups.values():
        g["mean_us"] = g["total_us"] / max(g["count"], 1)
        g["count"] /= num_steps
        g["total_us"] /= num_steps
    top = sorted(names.items(), key=lambda item: -item[1])[:15]
    return {"kernels_per_step": len(kernels) / num_steps,
            "kernel_ms": sum(k["dur"] for k in kernels) / num_steps / 1e3,
            "groups": dict(sorted(groups.items(), key=lambda item: -item[1]["total_us"])),
            "top_kernels": [{"name": n[:160], "us_per_step": t / num_steps} for n, t in top]}


def projection_times(kernels: list[dict], num_layers: int) -> dict[str, list[float]] | None:
    """GEMM durations (us) by projection, from GEMMs in launch order: qkv, o, gate_up, down
    per layer, then the LM head; a split-K reduce joins the GEMM before it. None if the
    count does not fit that pattern."""
    gemms: list[float] = []
    for k in kernels:
        if group_of(k["name"]) != "gemm":
            continue
        if "reduce" in k["name"].lower() and gemms:
            gemms[-1] += k["dur"]
        else:
            gemms.append(k["dur"])
    period = 4 * num_layers + 1
    if not gemms or len(gemms) % period:
        return None
    out: dict[str, list[float]] = {name: [] for name in PROJECTIONS + ("lm_head",)}
    for j, dur in enumerate(gemms):
        i = j % period
        out["lm_head" if i == period - 1 else PROJECTIONS[i % 4]].append(dur)
    return out


def projection_bytes(model) -> dict[str, int]:
    """Weight bytes one GEMM of each projection reads (one layer; the LM head)."""
    cfg, item = model.config, 2  # bf16
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (q_dim + 2 * kv_dim) * h * item, "o": h * q_dim * item,
            "gate_up": 2 * inter * h * item, "down": h * inter * item,
            "lm_head": model.output_weight.shape[0] * h * item}


def gbs_table(times: dict[str, list[float]], nbytes: dict[str, int]) -> dict[str, dict]:
    return {name: {"count": len(ts), "mean_us": sum(ts) / len(ts),
                   "gbs": nbytes[name] * len(ts) / (sum(ts) * 1e-6) / 1e9}
            for name, ts in times.items() if ts}


def profile_kernels(fn, reps: int, trace_path: str | None) -> list[dict]:
    """Device activity (kernels, memcpy, memset) of reps calls, in start order, from the
    profiler's chrome trace (its format is stable across torch releases)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = [{"name": e["name"], "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0))}
               for e in events if e.get("ph") == "X"
               and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(kernels, key=lambda k: k["ts"])
