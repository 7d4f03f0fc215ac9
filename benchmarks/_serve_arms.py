"""serve.py's arms: one plan served by the base server and then by one with FP8 flags
(`--quantization fp8`, `--kv-cache-dtype fp8`), in one run on one machine, so that their ratios
hold one run's conditions. An arm differs from the base only by those flags: `_roofline.py` and
`structgen serve` both get them, and every workload, prompt and KV-cache budget is the same.

A shape's result is the base arm's, then every other arm's workloads named by their arm
(`free 512/128 c=64 (fp8)`), `arms` (each arm's flags, server, roofline, KV pages, group
results) and `over_base`: each such workload over the base's of the same name.
"""
from __future__ import annotations

from dataclasses import dataclass

from benchmarks._serve_summary import fmt_ratio, side_ratios


@dataclass(frozen=True)
class Arm:
    """A server configuration of the run: `flags` go to `structgen serve` and `_roofline.py`."""

    name: str                     # "bf16" (float32 on the CPU), "fp8", "fp8-kv", "fp8+fp8-kv"
    flags: tuple[str, ...] = ()
    suffix: str = ""              # after each workload's name: "" for the base, " (fp8)"


def serve_arms(device: str, quantization: str | None, kv_cache_dtype: str) -> list[Arm]:
    """The base arm alone, or it and then the arm of the FP8 flags given."""
    base = Arm("float32" if device == "cpu" else "bf16")  # serve.py's CPU server runs --dtype float32
    names = ([quantization] if quantization else []) + (["fp8-kv"] if kv_cache_dtype == "fp8" else [])
    if not names:
        return [base]
    flags = (("--quantization", quantization) if quantization else ()) + (
        ("--kv-cache-dtype", kv_cache_dtype) if kv_cache_dtype != "auto" else ())
    name = "+".join(names)
    return [base, Arm(name, flags, f" ({name})")]


def kv_budget_flags(config, num_tokens: int | None, device: str) -> tuple[str, ...]:
    """`--kv-memory-budget-bytes` of `num_tokens` tokens in the base arm's KV dtype (bf16, float32
    on the CPU), the same bytes for every arm: e4m3 pages hold 2x (4x) the tokens in them."""
    if not num_tokens:
        return ()
    element_bytes = 4 if device == "cpu" else 2
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * element_bytes  # K and V
    return ("--kv-memory-budget-bytes", str(num_tokens * per_token))


def join_arms(shapes: list[dict]) -> dict:
    """One shape's result from its arms' results, base first (a single arm's unchanged). Reads
    its inputs only: called again as the run goes on."""
    base = shapes[0]
    if len(shapes) == 1:
        return base
    by_name = {w["name"]: w for w in base["workloads"]}
    out = dict(base, workloads=list(base["workloads"]), over_base={},
               arms=[{k: v for k, v in s.items() if k not in ("workloads", "shape", "model")} for s in shapes])
    for other in shapes[1:]:
        for w in other["workloads"]:
            out["workloads"].append(w)
            twin = by_name.get(w["name"].removesuffix(f" ({w['arm']})"))
            if twin is not None:
                out["over_base"][w["name"]] = arm_ratios(w, twin)
    return out


def arm_ratios(w: dict, base: dict) -> dict:
    """Workload `w` of an arm over `base`, the base arm's of the same name (> 1: `w` higher), and
    beside them each one's preemptions, constrained / free-matched and batch-1 step over its own
    arm's weight-read floor, where it has them."""
    out = {"base": base["name"], **side_ratios(w, base)}
    for key in ("num_preemptions", "constrained_over_matched_free", "step_over_weight_floor"):
        values = {s["arm"]: s["engine"].get(key) if key == "num_preemptions" else s.get(key) for s in (base, w)}
        if any(v is not None for v in values.values()):
            out[key] = values
    return out


def ratio_line(name: str, ratios: dict) -> str:
    """`arm_ratios` in one line: "free 512/128 c=64 (fp8) over free 512/128 c=64: output_tok_s 1.612, ...,
    num_preemptions bf16 0 / fp8 0"."""
    def fmt(key: str, value) -> str:
        if not isinstance(value, dict):
            return fmt_ratio(value)
        return " / ".join(f"{arm} " + ("-" if v is None else f"{v:.0f}" if key == "num_preemptions" else fmt_ratio(v))
                          for arm, v in value.items())
    return f"  {name} over {ratios['base']}: " + ", ".join(
        f"{key} {fmt(key, value)}" for key, value in ratios.items() if key != "base")
