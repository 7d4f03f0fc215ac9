"""The serving benchmark: the real `structgen serve` on the GPU, driven over gRPC from several
client processes, each result next to the same run's roofline (issue 16).

    python benchmarks/serve.py --out benchmarks/results/serve-h200.json            # every workload
    python benchmarks/serve.py --plan quick --out /tmp/serve.json                   # a short subset
    python benchmarks/serve.py --device cpu --shapes tiny-random --plan smoke ...       # CPU: the harness only
    python benchmarks/serve.py --plan http --shapes llama-3.1-8b --out ...          # HTTP vs gRPC, same server
    python benchmarks/serve.py --plan prefix --shapes llama-3.1-8b --out benchmarks/results/serve-h200-prefix.json
    python benchmarks/serve.py --plan features --shapes llama-3.1-8b --out ...      # tools/reasoning beside ordinary
    python benchmarks/serve.py --plan forced --shapes llama-3.1-8b --out ...        # grammar-forced drafts, c=1
    python benchmarks/serve.py --plan quick --shapes llama-3.1-70b --tensor-parallel 4 --out ...   # sharded, 4 GPUs

Per model shape (random weights of a preset shape, the real 131k Tekken tokenizer beside them):
1. roofline (its own process, `_roofline.py`): bf16 matmul rate, copy bandwidth, and the free
   decode graph's step time at every batch and mean context the workloads use;
2. `structgen serve --device cuda` with that model (grammar_service as its child), then the
   workloads one after another, each from `--client-procs` processes (`_serve_load.py`):
   - idle TTFT: one request at a time, prompts of 1k, 4k and 8k tokens;
   - closed loop at each concurrency: free (`ignore_eos`, max_tokens new tokens), constrained
     (a JSON Schema with bounded fields, compact, capped at max_tokens) and free-matched (free
     requests capped at the constrained run's output lengths, cycled: the same length mix);
   - open loop: Poisson arrivals at fractions of the closed-loop rate at the largest concurrency.
   Every request of these carries tokens unique to it: no prompt prefix is shared, the prefix
   cache finds nothing.
   Plan `http`: the 512/128 closed loop at concurrency 64, free and constrained, over gRPC
   and then over the OpenAI-compatible HTTP API (`--http-port`, /v1/completions streamed with
   the same token ids) of the same server; `http_over_grpc` is the ratio of output tok/s.
2b. prefix caching, the same run: the server above (cache on) and then a second one with
   `--prefix-caching false`, each with the same three workloads:
   - shared prefix: a 2,048-token system prompt, then a 64-token tail unique to each request,
     JSON-Schema constrained, closed loop at concurrency 16;
   - multi-turn: conversations of 4 turns, each turn resending the conversation (the prompt,
     every answer, a new 64-token message), free, closed loop;
   - no shared prefix: a 512/128 free closed loop, to show what the cache costs when it never hits;
   and the ratios cache on / off (`prefix_cache`: TTFT p50/p99, output tok/s). Plan `prefix`: these alone.
2c. Plan `features` (issue 20's target: reasoning and tools cost nothing to requests that use
   neither), one server: ordinary requests (free 512/128, concurrency 16) alone; beside, in
   the same window, 4 users each of chat requests with two tools (tool_choice auto; required)
   and of requests with a reasoning span (markers given in the request, a 32-token budget
   after which the end marker is forced, then the JSON Schema); beside as many plain users
   (the same prompts, tools shown with tool_choice none, free at the feature requests' output
   lengths: the same batch and turnover without the features); alone again (the A/A floor).
   `features`: the ordinary requests' ratios (output tok/s, TTFT, inter-token p50/p99, the
   engine's ms per graph step) beside features over alone and over beside plain. With random
   weights the model never writes its tool-call trigger: auto requests are free text under
   the trigger's grammar, required ones are calls the grammar writes; every parsed call and
   every post-span document is validated (`tool_call_validation`, `validation`; a document
   whose violations the guarantee report names counts as VALIDATION_STATUS_INVALID_REPORTED_GAP:
   a reasoning budget takes xgrammar, whose length-limited strings admit raw control characters).
   Preset shapes get the tokenizer's chat template beside it (Tekken's: Mistral's [TOOL_CALLS]).
   Per workload: output tok/s over the measured window, TTFT p50/p99, inter-token (gap between
   streamed messages) p50/p99, tokens per message, errors by code, finish reasons, validation
   statuses, and the engine's step counters over the window (GetEngineStats).
   With --tensor-parallel N > 1 the server shards the model over N GPUs and the roofline has
   no decode-graph steps (that runner is single-GPU; a 70B shape does not fit one GPU): it
   gives the per-GPU weight-read floor instead (the weights' bytes / N at the copy
   bandwidth), and the batch-1 closed loop reports its inter-token p50 over that floor
   (`step_over_weight_floor`).
3. Each closed-loop result over its roofline: C requests of P prompt tokens and N new tokens take
   C x prefill_flops(P) / matmul rate + N x decode step(C, context P + N/2), so
   roofline tok/s = C x N / that; idle TTFT over prefill_flops(P) / rate + one decode step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._harness import (  # noqa: E402
    VOCAB, ServeProcess, code_commit, command_line, free_port, log, random_model_folder, write_result,
)
from benchmarks._serve_load import (  # noqa: E402
    CANCELLED_AT_END, BenchTool, Record, Workload, make_prompts, run_workload, run_workloads,
)

# Bounded fields: every document completes well inside 128 tokens of the Tekken vocabulary.
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
    "name": {"type": "string", "minLength": 3, "maxLength": 24},
    "status": {"enum": ["new", "open", "blocked", "done"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 4},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 6},
    "active": {"type": "boolean"}},
    "required": ["id", "name", "status", "tags", "scores", "active"], "additionalProperties": False}
# Tools of the feature requests: bounded arguments, so a call completes under any model.
TOOLS = (BenchTool("get_weather", "The current weather of a city.", json.dumps({
    "type": "object", "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False})),
    BenchTool("create_ticket", "Open a ticket with these fields.", json.dumps(SCHEMA)))
PLANS = ("full", "quick", "load", "smoke", "http", "http-smoke", "prefix", "features", "features-smoke", "forced")
# `--plan forced` (issue 26): one user at a time, documents the grammar mostly forces, greedy, without
# speculation and with each proposer (prompt tokens, drafts per step)
FORCED_PLAN = (64, 4)


# ---- the server ---------------------------------------------------------------------------------
class Server(ServeProcess):
    """`structgen serve` in its own process; its log in a file."""

    def __init__(self, model: str, args, log_path: pathlib.Path, max_batch: int, http: bool = False,
                 extra: tuple[str, ...] = ()) -> None:
        command = [sys.executable, "-c", "import sys; from structgen.cli import main; sys.exit(main())",
                   "serve", "--model", model, "--device", args.device,
                   "--port", "0", "--max-batch", str(max_batch), "--max-waiting", "4096",
                   "--max-prompt-tokens", "8192", "--max-new-tokens-limit", "1024",
                   "--num-workers", str(max_batch + 64), "--tensor-parallel", str(args.tensor_parallel),
                   *extra, *args.server_args]
        if args.device == "cpu":
            command += ["--dtype", "float32"]
        if http:  # the OpenAI-compatible API beside gRPC, same process and engine
            command += ["--http-port", str(free_port())]
        super().__init__(command, log_path, env={"PYTHONUNBUFFERED": "1"})
        import grpc

        from structgen.v1 import generation_pb2 as pb
        from structgen.v1 import generation_pb2_grpc as pb_grpc
        self.pb, self.stub = pb, pb_grpc.GenerationServiceStub(grpc.insecure_channel(self.address))

    def model_info(self) -> dict:
        from google.protobuf.json_format import MessageToDict
        return MessageToDict(self.stub.GetModelInfo(self.pb.GetModelInfoRequest()), preserving_proto_field_name=True)

    def stats(self) -> dict:
        from google.protobuf.json_format import MessageToDict
        return MessageToDict(self.stub.GetEngineStats(self.pb.GetEngineStatsRequest()),
                             preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    def wait_idle(self, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if int(stats["num_running"]) == int(stats["num_waiting"]) == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    def warm(self, prompts: list[list[int]], schema: str) -> float:
        """One free and one constrained request per prompt before anything is measured: a fresh
        server's first requests pay one-time costs (a compile worker's start, first kernels of a
        shape) that are not what a workload measures. Returns the seconds it took."""
        started = time.monotonic()
        for prompt in prompts:
            for constrained in (False, True):
                request = self.pb.GenerateRequest(
                    token_ids=self.pb.TokenIds(ids=prompt), sampling=self.pb.SamplingParams(temperature=0.0),
                    stop=self.pb.StopConditions(max_tokens=4, ignore_eos=not constrained))
                if constrained:
                    request.json_schema = schema
                    request.constraint_options.compact = True
                for _ in self.stub.Generate(request, timeout=600):
                    pass
        return time.monotonic() - started


# ---- results ------------------------------------------------------------------------------------
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
        "concurrency": workload.concurrency, "rate_rps": workload.rate, "constrained": workload.json_schema is not None,
        "matched_lengths": bool(workload.max_tokens_list), "num_requests": len(records),
        "num_finished": len(finished),
        "output_tokens_per_s": tokens / window if window else None,
        "requests_per_s": sum(1 for r in finished if lo <= r.end < hi) / window if window else None,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
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
        "num_prefix_cache_evictions", "num_draft_tokens_proposed", "num_draft_tokens_accepted")}
    d["graph_steps"] = d["num_steps"] - d["num_mixed_steps"]
    d["busy_fraction"] = (d["graph_step_seconds"] + d["mixed_step_seconds"]) / seconds if seconds else None
    d["ms_per_graph_step"] = 1e3 * d["graph_step_seconds"] / d["graph_steps"] if d["graph_steps"] else None
    d["ms_per_mixed_step"] = 1e3 * d["mixed_step_seconds"] / d["num_mixed_steps"] if d["num_mixed_steps"] else None
    d["prefill_tokens_per_mixed_step"] = d["num_prefill_tokens"] / d["num_mixed_steps"] if d["num_mixed_steps"] else None
    return d


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


# ---- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixPlan:
    """The prefix-caching workloads (2b. above), each run with the cache on and off."""

    shared_len: int        # the shared system prompt
    tail_len: int          # each request's own part after it
    new_tokens: int
    concurrency: int
    turn_prompt_len: int   # multi-turn: the first turn's prompt
    turns: int
    unshared: tuple[int, int, int]  # (prompt, new tokens, concurrency) with no prefix shared


PREFIX_PLAN = PrefixPlan(2048, 64, 128, 16, 1024, 4, (512, 128, 16))


@dataclass(frozen=True)
class FeaturesPlan:
    """Ordinary requests alone and beside requests with tools and reasoning (2c. above)."""

    prompt_len: int
    new_tokens: int            # of each ordinary request
    concurrency: int           # ordinary users
    feature_concurrency: int   # users of each feature workload
    feature_max_tokens: int    # of a feature request (the reasoning span's budget on top)
    reasoning_budget: int


FEATURES_PLAN = FeaturesPlan(512, 128, 16, 4, 192, 32)


def plan(shape: str, name: str, duration: float, warmup: float) -> dict:
    """idle TTFT prompt lengths, closed-loop (prompt, new tokens, concurrencies), Poisson fractions,
    the prefix-caching workloads (`prefix`: a PrefixPlan, if any), the features' (`features`)."""
    if name in ("features", "features-smoke"):
        features = FEATURES_PLAN if name == "features" else FeaturesPlan(48, 16, 4, 1, 96, 4)
        return {"idle": [], "closed": [], "poisson": [], "poisson_at": None, "features": features}
    if name in ("http", "http-smoke"):  # the same server over gRPC and over HTTP, one after the other
        closed = [(48, 16, [4])] if name == "http-smoke" else [(512, 128, [64])]
        return {"idle": [], "closed": [], "http": closed, "poisson": [], "poisson_at": None}
    if name == "smoke":
        return {"idle": [64], "closed": [(48, 16, [1, 4])], "poisson": [0.5], "poisson_at": (48, 16, 4),
                "prefix": PrefixPlan(256, 16, 16, 4, 64, 3, (48, 16, 4))}
    if name == "forced":
        return {"idle": [], "closed": [], "poisson": [], "poisson_at": None, "forced": FORCED_PLAN}
    if name == "load":  # the loaded closed loop alone
        return {"idle": [], "closed": [(512, 128, [64, 128])], "poisson": [], "poisson_at": None}
    if name == "prefix":  # the prefix-caching workloads alone
        return {"idle": [], "closed": [], "poisson": [], "poisson_at": None, "prefix": PREFIX_PLAN}
    if name == "quick" and shape != "llama-3.2-1b":
        return {"idle": [1024, 8192], "closed": [(512, 128, [1, 64, 128])], "poisson": [],
                "poisson_at": None, "prefix": PREFIX_PLAN}
    if shape == "llama-3.2-1b":
        return {"idle": [1024], "closed": [(512, 128, [128])], "poisson": [], "poisson_at": None}
    return {"idle": [1024, 4096, 8192], "closed": [(512, 128, [1, 16, 64, 128, 256]), (2048, 128, [64]),
                                                   (512, 256, [64])],
            "poisson": [0.5, 1.0], "poisson_at": (512, 128, 128), "prefix": PREFIX_PLAN}


def run_shape(shape: str, args, tokenizer_dir: pathlib.Path, tmp: pathlib.Path, save) -> dict:
    """Roofline, server, workloads of one shape; `save(result)` after every workload (a run cut
    short keeps what it measured)."""
    from generation_service.model.loader import read_config
    p = plan(shape, args.plan, args.duration, args.warmup)
    if shape == "tiny-random":  # CPU harness check: the built-in random-weight model, its own tokenizer
        from generation_service.model.tiny_random_model import ensure_tiny_random_model
        folder = ensure_tiny_random_model()
        model = str(folder)
    else:
        # the Tekken vocabulary and room for 8k prompts
        folder = random_model_folder(shape, tokenizer_dir, tmp / shape, VOCAB, max_positions=16384)
        if (tokenizer_dir / "chat_template.jinja").is_file():  # tools are chat input: the template renders them
            shutil.copy(tokenizer_dir / "chat_template.jinja", folder)
        model = f"random:{folder / 'config.json'}"
    config = read_config(folder / "config.json")
    prefix: PrefixPlan | None = p.get("prefix")
    features: FeaturesPlan | None = p.get("features")
    concurrencies = sorted({c for _, _, cs in p["closed"] + p.get("http", []) for c in cs} | {1}
                           | ({prefix.concurrency, prefix.unshared[2]} if prefix else set())
                           | ({features.concurrency + 3 * features.feature_concurrency} if features else set()))
    max_batch = max(concurrencies + [args.min_max_batch])
    roofline = None
    points = sorted({f"{c}:{int(pl + n / 2)}" for pl, n, cs in p["closed"] + p.get("http", []) for c in cs}
                    | {f"1:{pl}" for pl in p["idle"]})  # idle TTFT: one decode step after the prompt
    if args.device == "cuda" and points:
        out = tmp / f"roofline-{shape}.json"
        log(f"{shape}: roofline (decode graph at batch:context {points})")
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "_roofline.py"), "--config",
                        str(folder / "config.json"), "--points", *points, "--out", str(out),
                        "--tensor-parallel", str(args.tensor_parallel)], check=True, cwd=ROOT)
        roofline = json.loads(out.read_text())
    log(f"{shape}: starting the server")
    server = Server(model, args, tmp / f"server-{shape}.log", max_batch, http=bool(p.get("http")))
    log(f"{shape}: listening at {server.address} after {server.startup_s:.1f} s")
    result = {"shape": shape, "model": model, "server_command": server.command, "server_startup_s": server.startup_s,
              "model_info": server.model_info(), "roofline": roofline, "workloads": []}
    lengths = set(p["idle"]) | {pl for pl, _, _ in p["closed"] + p.get("http", [])}
    if p.get("forced"):
        lengths.add(p["forced"][0])
    if prefix:
        lengths |= {prefix.shared_len, prefix.tail_len, prefix.turn_prompt_len, prefix.unshared[0]}
    if features:
        lengths.add(features.prompt_len)
    prompts = make_prompts(str(folder / "tokenizer.json"), lengths, 64, seed=1)
    schema = json.dumps(SCHEMA)
    warm_prompts = [prompts[n][0][::-1] for n in sorted(prompts)]  # reversed: no prefix a workload's prompts share
    log(f"{shape}: warm-up, {len(warm_prompts)} prompt lengths, free and constrained: "
        f"{server.warm(warm_prompts, schema):.1f} s")
    common = dict(duration_s=args.duration, warmup_s=args.warmup)
    lengths: dict[str, list[int]] = {}

    def run(workload: Workload, roof: float | None = None, on: Server | None = None,
            prompt_set: list[list[int]] | None = None) -> dict:
        on = on or server
        on.wait_idle()
        before = on.stats()
        address = on.http_url if workload.transport == "http" else on.address
        profilers = profile_server(args, on, shape, workload)
        records = run_workload(address, workload, prompt_set or prompts[workload.prompt_len], args.client_procs,
                               salt=len(result["workloads"]) << 30)  # request numbers apart from every other run's
        summary = summarize(workload, records)
        for process, profiler in profilers.items():
            profiler.wait(timeout=60)
            summary.setdefault("profile", {})[process] = profile_summary(
                pathlib.Path(profiler.args[profiler.args.index("--output") + 1]),
                workload.warmup_s + workload.duration_s + 3)
        lengths[workload.name] = output_lengths(records)
        summary["engine"] = step_delta(before, on.wait_idle(), workload.warmup_s + workload.duration_s
                                       if not workload.num_requests else 0)
        if roof:
            summary["roofline_tokens_per_s"] = roof
            summary["over_roofline"] = summary["output_tokens_per_s"] / roof if summary["output_tokens_per_s"] else None
        result["workloads"].append(summary)
        save(result)
        log(line(summary))
        return summary

    def run_together(workloads: list[tuple[Workload, list]]) -> list[dict]:
        """Workloads in one window on `server`: the first from --client-procs processes, the others
        from one each; `engine`: the window's step counters, every workload's requests together."""
        server.wait_idle()
        before = server.stats()
        runs = [(w, ps, args.client_procs if i == 0 else 1) for i, (w, ps) in enumerate(workloads)]
        records = run_workloads(server.address, runs, salt=len(result["workloads"]) << 30)
        engine = step_delta(before, server.wait_idle(), workloads[0][0].warmup_s + workloads[0][0].duration_s)
        summaries = []
        for (workload, _), these in zip(workloads, records):
            summaries.append(summarize(workload, these) | {"engine": engine})
            lengths[workload.name] = output_lengths(these)
            log(line(summaries[-1]))
        result["workloads"] += summaries
        save(result)
        return summaries

    try:
        for prompt_len in p["idle"]:
            s = run(Workload(f"idle-ttft-{prompt_len}", prompt_len, 2, num_requests=3, ignore_eos=True))
            if roofline and roofline["decode_steps"]:
                from benchmarks._roofline import prefill_flops
                floor_s = (prefill_flops(config, prompt_len) / (roofline["matmul_tflops"] * 1e12)
                           + decode_step_ms(roofline, 1, prompt_len) / 1e3)
                s["ttft_floor_s"] = floor_s
                s["ttft_over_floor"] = statistics.median(s["ttft_s"]) / floor_s
                log(f"  idle TTFT {prompt_len}: median {statistics.median(s['ttft_s']) * 1e3:.1f} ms, "
                    f"floor {floor_s * 1e3:.1f} ms, x{s['ttft_over_floor']:.2f}")
        for prompt_len, new_tokens, concurrencies_here in p["closed"]:
            for c in concurrencies_here:
                tag = f"{prompt_len}/{new_tokens} c={c}"
                roof = roofline_tok_s(roofline, config, c, prompt_len, new_tokens) if roofline else None
                free = run(Workload(f"free {tag}", prompt_len, new_tokens, concurrency=c, **common), roof)
                if c == 1 and roofline and roofline.get("weight_read_floor_ms") and free["itl_p50_ms"]:
                    free["step_over_weight_floor"] = free["itl_p50_ms"] / roofline["weight_read_floor_ms"]
                    log(f"  batch-1 step (ITL p50) over the per-GPU weight-read floor "
                        f"{roofline['weight_read_floor_ms']:.2f} ms: x{free['step_over_weight_floor']:.2f}")
                constrained = run(Workload(f"constrained {tag}", prompt_len, new_tokens, concurrency=c,
                                           json_schema=schema, ignore_eos=False, **common))
                if roofline and constrained["mean_output_len"]:
                    n = constrained["mean_output_len"]
                    constrained["roofline_tokens_per_s"] = roofline_tok_s(roofline, config, c, prompt_len, n)
                    constrained["over_roofline"] = constrained["output_tokens_per_s"] / constrained["roofline_tokens_per_s"]
                matched = run(Workload(f"free-matched {tag}", prompt_len, new_tokens, concurrency=c,
                                       max_tokens_list=lengths[constrained["name"]] or [new_tokens], **common),
                              constrained.get("roofline_tokens_per_s"))
                matched["constrained_over_matched_free"] = (
                    constrained["output_tokens_per_s"] / matched["output_tokens_per_s"]
                    if matched["output_tokens_per_s"] else None)
                log(f"  constrained / free at matched lengths: {matched['constrained_over_matched_free']:.3f}"
                    f" (free at {new_tokens}: {free['output_tokens_per_s']:.1f} tok/s)")
        for prompt_len, new_tokens, concurrencies_here in p.get("http", []):
            for c in concurrencies_here:
                tag = f"{prompt_len}/{new_tokens} c={c}"
                roof = roofline_tok_s(roofline, config, c, prompt_len, new_tokens) if roofline else None
                for kind, extra in (("free", {}), ("constrained", {"json_schema": schema, "ignore_eos": False})):
                    over_grpc = run(Workload(f"{kind} {tag} grpc", prompt_len, new_tokens, concurrency=c,
                                             **extra, **common), roof)
                    over_http = run(Workload(f"{kind} {tag} http", prompt_len, new_tokens, concurrency=c,
                                             transport="http", **extra, **common), roof)
                    over_http["http_over_grpc"] = (over_http["output_tokens_per_s"] / over_grpc["output_tokens_per_s"]
                                                   if over_grpc["output_tokens_per_s"] else None)
                    log(f"  {kind} {tag}: HTTP / gRPC output tok/s {over_http['http_over_grpc']:.3f}")
        if p["poisson"] and p["poisson_at"]:
            prompt_len, new_tokens, c = p["poisson_at"]
            ref = next(w for w in result["workloads"] if w["name"] == f"free {prompt_len}/{new_tokens} c={c}")
            for fraction in p["poisson"]:
                rate = fraction * ref["requests_per_s"]
                s = run(Workload(f"poisson {prompt_len}/{new_tokens} {fraction:.2f}x ({rate:.1f} req/s)", prompt_len,
                                 new_tokens, rate=rate, **common))
                s["offered_tokens_per_s"] = rate * new_tokens
        cached = prefix_workloads(prefix, prompts, schema, common, lambda w, ps: run(w, prompt_set=ps),
                                  "cache on") if prefix else None
        if p.get("forced"):
            result["forced_drafts"] = forced_workloads(*p["forced"], prompts, common, run)
        if features:
            from tokenizers import Tokenizer
            decode = Tokenizer.from_file(str(folder / "tokenizer.json")).decode
            texts = [decode(ids) for ids in prompts[features.prompt_len]]  # chat input: the same text
            result["features"] = feature_workloads(features, prompts[features.prompt_len], texts, schema, common,
                                                   run_together, lengths)
            for name, ratios in result["features"].items():
                log(f"  ordinary requests, {name}: " + ", ".join(f"{k} {fmt_ratio(v)}" for k, v in ratios.items()))
    finally:
        result["server_log"] = server.log_lines(r"prefill budget|prefill chunk|captured|ERROR|Traceback|error")[-40:]
        server.stop()
    if prefix:  # NOTE: after the first server stopped: each sizes its KV cache to the free GPU memory
        log(f"{shape}: starting the server without prefix caching")
        off = Server(model, args, tmp / f"server-{shape}-no-prefix-cache.log", max_batch,
                     extra=("--prefix-caching", "false"))
        try:
            log(f"{shape}: warm-up: {off.warm(warm_prompts, schema):.1f} s")
            uncached = prefix_workloads(prefix, prompts, schema, common, lambda w, ps: run(w, on=off, prompt_set=ps),
                                        "cache off")
        finally:
            off.stop()
        result["prefix_cache"] = {name: cache_ratios(cached[name], uncached[name]) for name in cached}
        save(result)
        for name, ratios in result["prefix_cache"].items():
            log(f"  prefix cache, {name}: " + ", ".join(f"{k} {fmt_ratio(v)}" for k, v in ratios.items()))
    return result


def forced_workloads(prompt_len: int, drafts: int, prompts: dict, common: dict, run) -> dict:
    """Concurrency 1 over a schema whose documents the grammar mostly forces (long keys, enums, a const:
    benchmarks/forced_drafts.py's), greedy: without speculation, with grammar-forced drafts and with
    n-gram drafts. Per proposer: output tok/s over no speculation, drafts accepted / proposed, the
    documents' validation. (That greedy documents are the same with drafts as without is
    forced_drafts.py's check: here each request's prompt spells its own number.)"""
    from benchmarks.forced_drafts import SCHEMAS
    schema = json.dumps(SCHEMAS["shipment"])
    summaries = {}
    for proposer in ("none", "grammar", "ngram"):
        workload = Workload(f"forced-structure {prompt_len}/96 c=1 drafts {proposer}", prompt_len, 96, concurrency=1,
                            json_schema=schema, ignore_eos=False, num_draft_tokens=0 if proposer == "none" else drafts,
                            proposer="ngram" if proposer == "none" else proposer, **common)
        summaries[proposer] = run(workload)
    base = summaries["none"]["output_tokens_per_s"]
    ratios = {proposer: {"over_no_speculation": s["output_tokens_per_s"] / base if base else None,
                         "drafts_accepted": s["engine"]["num_draft_tokens_accepted"],
                         "drafts_proposed": s["engine"]["num_draft_tokens_proposed"],
                         "itl_p50_ms": s["itl_p50_ms"], "valid": s["validation"]}
              for proposer, s in summaries.items()}
    for proposer, r in ratios.items():
        log(f"  forced structure, {proposer}: x{fmt_ratio(r['over_no_speculation'])} output tok/s, drafts "
            f"{r['drafts_accepted']:.0f}/{r['drafts_proposed']:.0f}, ITL p50 {r['itl_p50_ms']:.1f} ms")
    return ratios


def profile_server(args, server: Server, shape: str, workload: Workload) -> dict[str, subprocess.Popen]:
    """`--profile TEXT`: py-spy samples the server through a workload whose name holds TEXT, one
    recorder per process ("serving", and "engine" when the engine runs in a process of its own):
    the GIL holder (`--profile-mode gil`) or every thread, idle or not (`wall`); the stacks (py-spy's
    raw format) go beside --out."""
    if not args.profile or args.profile not in workload.name:
        return {}
    places = [pathlib.Path(sys.prefix), *map(pathlib.Path, sys.path)]  # a venv's bin/, pip --target's bin/
    spy = shutil.which("py-spy") or next((str(p / "bin" / "py-spy") for p in places if (p / "bin" / "py-spy").is_file()),
                                         None)
    if spy is None:
        log("--profile: no py-spy found")
        return {}
    name = re.sub(r"[^A-Za-z0-9]+", "-", f"{shape} {workload.name}").strip("-")
    seconds = int(workload.warmup_s + workload.duration_s + 3)
    mode = ["--gil"] if args.profile_mode == "gil" else ["--idle"]
    pids = {"serving": server.process.pid}
    engine = engine_process_pid(server.process.pid)
    if engine is not None:
        pids["engine"] = engine
    recorders = {}
    for process, pid in pids.items():
        out = pathlib.Path(args.out).with_name(f"{pathlib.Path(args.out).stem}-profile-{name}-{process}.txt")
        recorders[process] = subprocess.Popen(
            [spy, "record", "--pid", str(pid), *mode, "--threads", "--nonblocking", "--rate", "200",
             "--duration", str(seconds), "--format", "raw", "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=open(str(out) + ".log", "w"))
    return recorders


def engine_process_pid(server_pid: int) -> int | None:
    """The engine process under `structgen serve` (--engine-process: a multiprocessing spawn child)."""
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == server_pid \
                    and b"multiprocessing.spawn" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except OSError:
            continue
    return None


def profile_summary(raw: pathlib.Path, seconds: float, rate: int = 200, top: int = 25) -> dict:
    """What py-spy's raw stacks say, small enough for the result: the share of the window each
    thread was sampled (under `--gil`: held the GIL), and the functions (inclusive) with the
    largest shares. Shares are of rate x seconds samples."""
    if not raw.is_file():
        return {"error": f"no profile at {raw.name}"}
    threads, functions, total = {}, {}, 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        thread = re.sub(r"^thread \(\w+\):\s*|\s*\(idle\)", "", frames[0]).strip() or frames[0]
        threads[thread] = threads.get(thread, 0) + n
        for frame in set(re.sub(r" \(.*?:\d+\)$", "", f) for f in frames[1:]):  # a function once per stack
            functions[frame] = functions.get(frame, 0) + n
    window = rate * seconds
    share = lambda n: round(n / window, 4)  # noqa: E731
    return {"samples": total, "window_samples": int(window), "sampled_share": share(total),
            "threads": {t: share(n) for t, n in sorted(threads.items(), key=lambda kv: -kv[1])},
            "top_functions": {f: share(n) for f, n in sorted(functions.items(), key=lambda kv: -kv[1])[:top]}}


def prefix_workloads(plan: PrefixPlan, prompts: dict, schema: str, common: dict, run, tag: str) -> dict[str, dict]:
    """The shared-prefix, multi-turn and unshared workloads on one server; summaries by kind."""
    shared = prompts[plan.shared_len][0]
    shared_prompts = [shared + tail for tail in prompts[plan.tail_len]]
    c, (unshared_len, unshared_new, unshared_c) = plan.concurrency, plan.unshared
    return {
        "shared_prefix": run(Workload(
            f"shared-prefix {plan.shared_len}+{plan.tail_len}/{plan.new_tokens} c={c} ({tag})",
            plan.shared_len + plan.tail_len, plan.new_tokens, concurrency=c, json_schema=schema, ignore_eos=False,
            unique_at=plan.shared_len, **common), shared_prompts),
        "multi_turn": run(Workload(
            f"multi-turn {plan.turn_prompt_len}+{plan.turns}x({plan.new_tokens}+{plan.tail_len}) c={c} ({tag})",
            plan.turn_prompt_len, plan.new_tokens, concurrency=c, turns=plan.turns, turn_tokens=plan.tail_len,
            **common), prompts[plan.turn_prompt_len]),
        "unshared": run(Workload(f"unshared {unshared_len}/{unshared_new} c={unshared_c} ({tag})", unshared_len,
                                 unshared_new, concurrency=unshared_c, **common), prompts[unshared_len]),
    }


def feature_workloads(plan: FeaturesPlan, prompts: list[list[int]], texts: list[str], schema: str, common: dict,
                      run_together, lengths: dict[str, list[int]]) -> dict[str, dict]:
    """The ordinary workload alone, beside the feature workloads, beside their plain counterparts,
    alone again; the ordinary requests' ratios."""
    c, fc = plan.concurrency, plan.feature_concurrency

    def ordinary(tag: str) -> tuple[Workload, list]:
        return Workload(f"ordinary {plan.prompt_len}/{plan.new_tokens} c={c} ({tag})", plan.prompt_len,
                        plan.new_tokens, concurrency=c, **common), prompts

    def feature(name: str, prompt_set: list, **kw) -> tuple[Workload, list]:
        return Workload(f"{name} {plan.prompt_len}/{plan.feature_max_tokens} c={fc}", plan.prompt_len,
                        plan.feature_max_tokens, concurrency=fc, ignore_eos=False, **kw, **common), prompt_set

    featured = [feature("tools-auto", texts, tools=TOOLS, tool_choice="auto"),
                feature("tools-required", texts, tools=TOOLS, tool_choice="required"),
                feature(f"reasoning-{plan.reasoning_budget}+schema", prompts, json_schema=schema,
                        reasoning_budget=plan.reasoning_budget)]
    alone = run_together([ordinary("alone")])[0]
    beside = run_together([ordinary("beside features")] + featured)[0]
    plain = [(dataclasses.replace(w, name=f"plain-matched ({w.name})", tool_choice="none", json_schema=None,
                                  reasoning_budget=None, ignore_eos=True,
                                  max_tokens_list=lengths[w.name] or [w.max_tokens]),
              ps) for w, ps in featured]  # the same prompts and output lengths, no feature in use
    beside_plain = run_together([ordinary("beside plain")] + plain)[0]
    again = run_together([ordinary("alone again")])[0]
    return {"beside_features_over_alone": side_ratios(beside, alone),
            "beside_features_over_beside_plain": side_ratios(beside, beside_plain),
            "alone_again_over_alone": side_ratios(again, alone)}


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
            + (f" calls {s['tool_call_validation']} reasoning {fmt(s['reasoning_fraction'], '.2f')}"
               if "tool_call_validation" in s else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "llama-3.2-1b"],
                        help="preset shapes (random weights), or 'tiny-random' (the built-in random-weight model, CPU smoke)")
    parser.add_argument("--plan", choices=PLANS, default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per workload")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before the window opens")
    parser.add_argument("--client-procs", type=int, default=4)
    parser.add_argument("--min-max-batch", type=int, default=1, help="the server's --max-batch at least this")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="the server's --tensor-parallel: GPUs the model is sharded over")
    parser.add_argument("--profile", default="", help="py-spy the server through workloads whose name holds this")
    parser.add_argument("--profile-mode", choices=("gil", "wall"), default="gil",
                        help="--profile samples the GIL holder, or every thread's wall time")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more `structgen serve` flags")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from tests.real_tokenizers import tokenizer_dir
    tok = pathlib.Path(os.environ.get("STRUCTGEN_TEKKEN_DIR") or tokenizer_dir("tekken_131k"))
    result = {"benchmark": "serve", "command": command_line(pathlib.Path(sys.argv[0]).name),
              "code_commit": code_commit(), "python": platform.python_version(), "client_procs": args.client_procs,
              "plan": args.plan, "tensor_parallel": args.tensor_parallel, "duration_s": args.duration, "warmup_s": args.warmup, "shapes": []}
    if args.device == "cuda":
        import torch
        result.update(device=torch.cuda.get_device_name(), torch=torch.__version__, cpus=os.cpu_count())
    with tempfile.TemporaryDirectory(prefix="structgen-serve-bench-") as tmp:
        for shape in args.shapes:
            done = list(result["shapes"])

            def save(partial: dict) -> None:
                result["shapes"] = done + [partial]
                write_result(args.out, result)
            save(run_shape(shape, args, tok, pathlib.Path(tmp), save))
    log("done: " + args.out)
    for shape in result["shapes"]:
        print(f"== {shape['shape']}")
        for s in shape["workloads"]:
            print(line(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
