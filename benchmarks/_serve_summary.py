"""serve.py's figures: a workload's summary from its client records (tok/s, TTFT, inter-token, errors,
finish reasons, validation), the engine's step counters over it (and its preemptions, from the
server's /metrics), the roofline a closed loop is held against, the ratios of one workload over
another, and the one-line print of a summary."""
from __future__ import annotations

import statistics

from benchmarks._serve_load import CANCELLED_AT_END, Record, Workload


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(workload: Workload, records: list[Record]) -> dict:
    """Figures over the measured window [warmup, warmup + duration] (idle runs: every request)."""
    lo, hi = (0.0, float("inf")) if workload.num_requests else (workload.warmup_s, workload.warmup_s + workload.duration_s)
    tokens = sum(n for r in records for t, n in zip(r.message_times, r.message_tokens) if lo <= t < hi)
    started = [r for r in records if lo <= r.start < hi]
    ttft = [r.ttft for r in started if r.ttft is not None]
    gaps = [b - a for r in records for a, b in zip(r.message_times, r.message_times[1:]) if lo <= b < hi]
    messages = sum(1 for r in records for t in r.message_times if lo <= t < hi)
    finished = [r for r in records if r.code == "OK"]
    count = lambda values: {k: values.count(k) for k in sorted(set(values))}  # noqa: E731
    window = (hi - lo) if not workload.num_requests else None
    out = {
        "name": workload.name, "prompt_len": workload.prompt_len, "max_tokens": workload.max_tokens,
        "concurrency": workload.concurrency, "rate_rps": workload.rate,
        "constrained": workload.json_schema is not None or bool(workload.json_schemas),
        "matched_lengths": bool(workload.max_tokens_list), "num_requests": len(records),
        "warmup_s": workload.warmup_s, "duration_s": workload.duration_s,
        "num_finished": len(finished),
        "output_tokens_per_s": tokens / window if window else None,
        "requests_per_s": sum(1 for r in finished if lo <= r.end < hi) / window if window else None,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "ttft_mean_s": statistics.mean(ttft) if ttft else None,
        "itl_p50_ms": _ms(percentile(gaps, 0.5)), "itl_p99_ms": _ms(percentile(gaps, 0.99)),
        "tokens_per_message": tokens / messages if messages else None,
        "errors": count([r.code for r in records if r.code not in ("OK", CANCELLED_AT_END)]),
        "finish_reasons": count([r.finish_reason for r in finished]),
        "validation": count([r.validation for r in finished if r.validation]),
        **({"tool_call_validation": count([v for r in records for v in r.call_validation]),
            "reasoning_fraction": sum(r.reasoning_chars > 0 for r in finished) / len(finished) if finished else None}
           if workload.tools or workload.reasoning_budget is not None else {}),
        "mean_output_len": statistics.mean([r.num_tokens for r in finished]) if finished else None,
        "mean_prompt_len": statistics.mean([r.prompt_len for r in finished]) if finished else None,
        # prompt tokens the server found in its prefix cache (usage.cached_prompt_tokens, gRPC)
        "cached_prompt_fraction": (sum(r.cached_tokens for r in finished) / sum(r.prompt_len for r in finished)
                                   if finished else None),
    }
    if workload.turns:
        out["turns"] = workload.turns
        for name, turns in (("first_turn", lambda t: t == 0), ("later_turns", lambda t: t > 0)):
            values = [r.ttft for r in started if turns(r.turn) and r.ttft is not None]
            out[f"ttft_p50_{name}_s"], out[f"ttft_p99_{name}_s"] = percentile(values, 0.5), percentile(values, 0.99)
    if workload.num_requests:
        out["ttft_s"] = ttft
    if workload.json_schemas:  # the requests whose grammar compiled (not cached): what a new schema costs
        compiled = [r for r in records if r.compile_ms is not None]  # the warm-up's too: most come first
        out["compile_ms"] = [r.compile_ms for r in compiled]
        out["cold_ttft_s"] = [r.ttft for r in compiled if r.ttft is not None]
    return out


def output_lengths(records: list[Record]) -> list[int]:
    """Tokens of each finished request: the lengths the free-matched run replays."""
    return [r.num_tokens for r in records if r.code == "OK" and r.num_tokens]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def step_delta(before: dict, after: dict, seconds: float) -> dict:
    """The engine's step counters over a workload: where the engine loop's time went."""
    d = {k: float(after[k]) - float(before[k]) for k in (
        "num_steps", "num_mixed_steps", "num_prefill_tokens", "graph_step_seconds", "mixed_step_seconds",
        "num_tokens_generated", "num_prefix_cache_query_tokens", "num_prefix_cache_hit_tokens",
        "num_prefix_cache_evictions", "num_draft_tokens_proposed", "num_draft_tokens_accepted",
        # slow grammars (engine/late_mask.py): rows found late, host steps asked for by held graphs
        "num_late_rows", "num_held_graph_host_steps")}
    d["graph_steps"] = d["num_steps"] - d["num_mixed_steps"]
    # launched before the step in flight was read (a server older than the counter: absent)
    if "num_chained_steps" in after:
        d["chained_fraction"] = ((float(after["num_chained_steps"]) - float(before["num_chained_steps"]))
                                 / d["num_steps"] if d["num_steps"] else None)
    # mixed steps whose constrained rows chained: their grammar step on the device (stream_channel.py)
    if "num_chained_grammar_steps" in after:
        d["chained_grammar_mixed_fraction"] = (
            (float(after["num_chained_grammar_steps"]) - float(before["num_chained_grammar_steps"]))
            / d["num_mixed_steps"] if d["num_mixed_steps"] else None)
    d["busy_fraction"] = (d["graph_step_seconds"] + d["mixed_step_seconds"]) / seconds if seconds else None
    d["ms_per_graph_step"] = 1e3 * d["graph_step_seconds"] / d["graph_steps"] if d["graph_steps"] else None
    d["ms_per_mixed_step"] = 1e3 * d["mixed_step_seconds"] / d["num_mixed_steps"] if d["num_mixed_steps"] else None
    d["prefill_tokens_per_mixed_step"] = d["num_prefill_tokens"] / d["num_mixed_steps"] if d["num_mixed_steps"] else None
    return d


# The server's request timings (Prometheus histograms, generation_service/metrics.py) whose
# means split a client's TTFT: in the servicer, waiting for a batch, prefilling, decoding
SERVER_TIMINGS = {
    "ttft_servicer": "structgen_time_to_first_token_seconds",
    "engine_queue": "structgen_request_queue_time_seconds",
    "engine_prefill": "structgen_request_prefill_time_seconds",
    "engine_decode": "structgen_request_decode_time_seconds",
    "request": "structgen_request_duration_seconds",
}


def histogram_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each SERVER_TIMINGS histogram in a /metrics scrape, over its labels."""
    from prometheus_client.parser import text_string_to_metric_families
    wanted = {name: key for key, name in SERVER_TIMINGS.items()}
    totals = {key: [0.0, 0.0] for key in SERVER_TIMINGS}
    for family in text_string_to_metric_families(metrics_text):
        key = wanted.get(family.name)
        for sample in family.samples if key else ():
            if sample.name.endswith("_sum"):
                totals[key][0] += sample.value
            elif sample.name.endswith("_count"):
                totals[key][1] += sample.value
    return {key: (total, count) for key, (total, count) in totals.items()}


def counter_delta(before: str, after: str, family: str) -> int:
    """How much a Prometheus counter (`family`, without _total; summed over its labels) grew
    between two /metrics scrapes: GetEngineStats has no preemption count, /metrics has."""
    from prometheus_client.parser import text_string_to_metric_families

    def total(text: str) -> float:
        return sum(sample.value for f in text_string_to_metric_families(text) if f.name == family
                   for sample in f.samples if sample.name == family + "_total")
    return round(total(after) - total(before))


def timing_means(before: str, after: str) -> dict[str, float | None]:
    """Mean seconds of each SERVER_TIMINGS histogram over the requests finished between two scrapes."""
    a, b = histogram_totals(before), histogram_totals(after)
    return {key: (b[key][0] - a[key][0]) / (b[key][1] - a[key][1]) if b[key][1] > a[key][1] else None
            for key in SERVER_TIMINGS}


def grammar_step_delta(before: str, after: str) -> dict[str, float | None]:
    """grammar_service's own steps between two scrapes of its /metrics: how many, their mean time
    and its phases per step (advance, fill, bookkeeping, grammar_service/loop.py), in us: whether
    the grammar step fits beside the forward it overlaps."""
    from prometheus_client.parser import text_string_to_metric_families

    def totals(text: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in ("structgen_grammar_step_seconds_sum", "structgen_grammar_step_seconds_count"):
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
                elif sample.name == "structgen_grammar_step_seconds_bucket":
                    out["le " + sample.labels["le"]] = out.get("le " + sample.labels["le"], 0.0) + sample.value
                elif sample.name == "structgen_grammar_step_phase_seconds_total":
                    out[sample.labels["phase"]] = out.get(sample.labels["phase"], 0.0) + sample.value
        return out
    a, b = totals(before), totals(after)
    steps = b.get("structgen_grammar_step_seconds_count", 0.0) - a.get("structgen_grammar_step_seconds_count", 0.0)
    per_step = lambda key: 1e6 * (b.get(key, 0.0) - a.get(key, 0.0)) / steps if steps else None  # noqa: E731
    # the share of steps slower than each bucket's bound: a few slow steps (a new row's first
    # fill) stall the steps they fall in, which a mean hides
    slower = {key[3:]: round(1 - (b[key] - a.get(key, 0.0)) / steps, 4) for key in b
              if key.startswith("le ") and key != "le +Inf"} if steps else {}
    return {"steps": steps, "step_us": per_step("structgen_grammar_step_seconds_sum"),
            **{f"{phase}_us": per_step(phase) for phase in ("advance", "fill", "bookkeeping")},
            "share_slower_than_s": slower}


def roofline_tok_s(roofline: dict, config, concurrency: int, prompt_len: int, new_tokens: float) -> float | None:
    """C x N output tokens over C prefills at the matmul rate + N decode steps at batch C."""
    from benchmarks._roofline import prefill_flops
    step = decode_step_ms(roofline, concurrency, prompt_len + new_tokens / 2)
    if step is None:
        return None
    seconds = (concurrency * prefill_flops(config, prompt_len) / (roofline["matmul_tflops"] * 1e12)
               + new_tokens * step / 1e3)
    return concurrency * new_tokens / seconds


def decode_step_ms(roofline: dict, batch: int, context: float) -> float | None:
    """The measured step at this batch, linear in context between the measured ones."""
    rows = sorted((r["context"], r["step_ms"]) for r in roofline["decode_steps"] if r["batch"] == batch)
    if not rows:
        return None
    if context <= rows[0][0] or len(rows) == 1:
        return rows[0][1]
    for (c0, t0), (c1, t1) in zip(rows, rows[1:]):
        if context <= c1:
            return t0 + (t1 - t0) * (context - c0) / (c1 - c0)
    return rows[-1][1]


def side_ratios(a: dict, b: dict) -> dict:
    """Workload a over b: output tok/s, TTFT, inter-token p50/p99, ms per graph step (> 1: a is higher)."""
    def ratio(x, y):
        return x / y if x is not None and y else None
    return {"output_tok_s": ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
            "ttft_p50": ratio(a["ttft_p50_s"], b["ttft_p50_s"]),
            "itl_p50": ratio(a["itl_p50_ms"], b["itl_p50_ms"]), "itl_p99": ratio(a["itl_p99_ms"], b["itl_p99_ms"]),
            "ms_per_graph_step": ratio(a["engine"]["ms_per_graph_step"], b["engine"]["ms_per_graph_step"])}


def cache_ratios(on: dict, off: dict) -> dict:
    """Cache on against off: TTFT off / on (> 1: faster with the cache), output tok/s on / off."""
    def ratio(a, b):
        return a / b if a is not None and b else None
    out = {"ttft_p50_off_over_on": ratio(off["ttft_p50_s"], on["ttft_p50_s"]),
           "ttft_p99_off_over_on": ratio(off["ttft_p99_s"], on["ttft_p99_s"]),
           "output_tok_s_on_over_off": ratio(on["output_tokens_per_s"], off["output_tokens_per_s"]),
           "cached_prompt_fraction_on": on["cached_prompt_fraction"]}
    if "ttft_p50_later_turns_s" in on:
        out["ttft_p50_later_turns_off_over_on"] = ratio(off["ttft_p50_later_turns_s"], on["ttft_p50_later_turns_s"])
    return out


def fmt_ratio(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def line(s: dict) -> str:
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    return (f"{s['name']:40s} {fmt(s['output_tokens_per_s'], '9.1f')} tok/s  TTFT p50 {fmt(s['ttft_p50_s'], '.3f')}"
            f" p99 {fmt(s['ttft_p99_s'], '.3f')} s  ITL p50 {fmt(s['itl_p50_ms'], '.1f')} p99 {fmt(s['itl_p99_ms'], '.1f')} ms"
            f"  x{fmt(s.get('over_roofline'), '.2f')} roofline  err {s['errors']} fin {s['finish_reasons']}"
            f" val {s['validation']} cached {fmt(s.get('cached_prompt_fraction'), '.2f')}"
            + (f" client cpu {s['client_cpu_max']:.2f}" if s.get("client_cpu_max") is not None else "")
            + (f" preempted {preempted:.0f}" if (preempted := s.get("engine", {}).get("num_preemptions")) else "")
            + (" server ms " + " ".join(f"{k} {fmt(v and 1e3 * v, '.1f')}" for k, v in means.items())
               if (means := s.get("server_mean_s") or s.get("engine", {}).get("server_mean_s")) else "")
            + (f" engine ms/step graph {fmt(e.get('ms_per_graph_step'), '.2f')} mixed {fmt(e.get('ms_per_mixed_step'), '.2f')}"
               if (e := s.get("engine")) else "")
            + (f" grammar step us {fmt(g['step_us'], '.0f')} (advance {fmt(g['advance_us'], '.0f')} fill"
               f" {fmt(g['fill_us'], '.0f')}) x{g['steps']:.0f}" if (g := s.get("grammar_steps")) and g["steps"] else "")
            + (f" calls {s['tool_call_validation']} reasoning {fmt(s['reasoning_fraction'], '.2f')}"
               if "tool_call_validation" in s else ""))
