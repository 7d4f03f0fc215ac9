"""The serving benchmark: the real `structgen serve` on the GPU, driven over gRPC from several
client processes, each result next to the same run's roofline (issue 16).

    python benchmarks/serve.py --out benchmarks/results/serve-h200.json            # every workload
    python benchmarks/serve.py --plan quick --out /tmp/serve.json                   # a short subset
    python benchmarks/serve.py --plan targets --out /tmp/serve.json                 # the workloads issue 16 sets targets for
    python benchmarks/serve.py --device cpu --shapes tiny-random --plan smoke ...       # CPU: the harness only
    python benchmarks/serve.py --plan http --shapes llama-3.1-8b --out ...          # HTTP vs gRPC, same server
    python benchmarks/serve.py --plan prefix --shapes llama-3.1-8b --out benchmarks/results/serve-h200-prefix.json
    python benchmarks/serve.py --plan features --shapes llama-3.1-8b --out ...      # tools/reasoning beside ordinary
    python benchmarks/serve.py --plan forced --shapes llama-3.1-8b --out ...        # grammar-forced drafts, c=1
    python benchmarks/serve.py --plan quick --shapes llama-3.1-70b --tensor-parallel 4 --out ...   # sharded, 4 GPUs
    python benchmarks/serve.py --plan fp8 --shapes llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 \
        --duration 3 --warmup 1 --out ...                                           # BF16, then FP8, one run

Per model shape (random weights of a preset shape, the real 131k Tekken tokenizer beside them):
1. roofline (its own process, `_roofline.py`): bf16 matmul rate, copy bandwidth, and the free
   decode graph's step time at every batch and mean context the workloads use; for each closed
   loop of 64 users or more, the mixed-step graph's time beside a prompt chunk (its replay on
   the GPU, and pack + upload + replay), against which the engine's own mixed steps are read;
2. `structgen serve --device cuda` with that model (grammar_service as its child), then the
   workloads one after another, each from `--client-procs` processes (`_serve_load.py`; the
   summaries `_serve_summary.py`, the groups beyond the closed loops `_serve_groups.py`,
   `--profile` `_serve_profile.py`):
   - idle TTFT: one request at a time, prompts of 1k, 4k and 8k tokens;
   - closed loop at each concurrency: free (`ignore_eos`, max_tokens new tokens), constrained
     (a JSON Schema with bounded fields, compact, capped at max_tokens) and free-matched (free
     requests capped at the constrained run's output lengths, cycled: the same length mix);
     with `--repeats K` the free one K times in a row (`free ... #2` ...; the first's `runs`
     lists each run's output tok/s and roofline ratio, `over_roofline_median` their median): an
     A/B of two servers can then read medians of one server's runs;
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
   statuses, and the engine's step counters over the window (GetEngineStats); the means of the
   server's request timings (`server_mean_s`: servicer TTFT, engine queue, prefill, decode, from
   its /metrics before and after), grammar_service's own steps over the window (`grammar_steps`:
   their count, mean time and phases, the share slower than each histogram bound, from the grammar
   child's /metrics) and the busiest client process's CPU share (`client_cpu_max`).
   `--concurrencies C ...` runs the plan's closed loops at those concurrencies only (a short run).
   The result's `host_python_ms` times a fixed Python loop on this host: host-bound figures of
   different machines compare only next to it.
   With --tensor-parallel N > 1 the server shards the model over N GPUs and the roofline has
   no decode-graph steps (that runner is single-GPU; a 70B shape does not fit one GPU): it
   gives the per-GPU weight-read floor instead (the weights' bytes / N at the copy
   bandwidth), and the batch-1 closed loop reports its inter-token p50 over that floor
   (`step_over_weight_floor`).
2d. FP8 arms: with --quantization fp8 and/or --kv-cache-dtype fp8 (`_serve_arms.py`)
   every step above runs twice per shape, first as it is (the bf16 arm), then with those flags
   given to `_roofline.py` and to `structgen serve` (nothing else differs: the same plan, prompts,
   random weights and KV-cache budget). The second arm's workloads are named by it (`free 512/128
   c=64 (fp8+fp8-kv)`), its roofline is its own (decode graphs of the quantized model over e4m3
   pages, the FP8 GEMM's rate, the FP8 weight-read floor, which its batch-1 `step_over_weight_floor`
   is read over), and `over_base` gives each such workload over its bf16 twin: output tok/s, TTFT
   p50, inter-token p50/p99, ms per graph step (> 1: the FP8 arm higher), with each arm's
   preemptions, constrained / free-matched and batch-1 step over its floor beside them. `arms`:
   each arm's server flags, roofline, KV pages and group results. Every workload reports the
   server's preemptions over it (`engine.num_preemptions`, from /metrics: GetEngineStats has none).
   Plan `fp8`: the workloads the issue's FP8 targets read, 512/128 closed loops, free at c=1 (step
   over the floor), 64 and 128 (output tok/s ratio), 256 (preemptions), and constrained beside
   free-matched at c=64; every arm's server gets --kv-memory-budget-bytes of 3/4 of the c=256
   loop's tokens in bf16: sized so that loop needs more bf16 pages than the budget holds and
   fewer e4m3 ones (--kv-cache-dtype fp8: twice the tokens in the same bytes). 8B with
   --duration 3 --warmup 1: about 2 minutes an arm (roofline ~25 s, server start ~30 s, warm-up
   ~5 s, six workloads ~60 s: estimated from the targets plan's 8B timings, not yet run), ~4.5
   minutes in all. `fp8-smoke`: the CPU's (c=4 of 48/64, its budget in float32).
3. Each closed-loop result over its roofline: C requests of P prompt tokens and N new tokens take
   C x prefill_flops(P) / matmul rate + N x decode step(C, context P + N/2), so
   roofline tok/s = C x N / that; idle TTFT over prefill_flops(P) / rate + one decode step.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._harness import (  # noqa: E402
    VOCAB, ServeProcess, code_commit, command_line, free_port, host_python_ms, log, random_model_folder, scrape,
    write_result,
)
from benchmarks._serve_arms import Arm, join_arms, kv_budget_flags, ratio_line, serve_arms  # noqa: E402
from benchmarks._serve_groups import (  # noqa: E402
    FEATURES_PLAN, FORCED_PLAN, PREFIX_PLAN, SCHEMA, FeaturesPlan, PrefixPlan, feature_workloads,
    forced_workloads, prefix_workloads,
)
from benchmarks._serve_constrained import CONSTRAINED_PLAN, ConstrainedPlan, compile_all, constrained_workloads  # noqa: E402
from benchmarks._serve_load import Workload, make_prompts, run_workload, run_workloads  # noqa: E402
from benchmarks._serve_profile import profile_server, profile_summary  # noqa: E402
from benchmarks._serve_summary import (  # noqa: E402
    cache_ratios, counter_delta, decode_step_ms, fmt_ratio, grammar_step_delta, line, output_lengths, roofline_tok_s,
    step_delta, summarize, timing_means,
)

# the prompt tokens of a loaded 1B mixed step (455 a step at c=128, serve-h200-1b-host-1-after.json)
MIXED_CHUNK_TOKENS = 448
PLANS = ("full", "targets", "quick", "load", "smoke", "http", "http-smoke", "prefix", "features", "features-smoke",
         "forced", "constrained", "constrained-smoke", "fp8", "fp8-smoke")


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
                   "--metrics-port", str(metrics_port := free_port()), *extra, *args.server_args]
        if args.device == "cpu":
            command += ["--dtype", "float32"]
        if http:  # the OpenAI-compatible API beside gRPC, same process and engine
            command += ["--http-port", str(free_port())]
        # the grammar child's own /metrics too: its step times beside the engine's
        grammar_port = free_port()
        super().__init__(command, log_path,
                         env={"PYTHONUNBUFFERED": "1", "STRUCTGEN_GRAMMAR_METRICS_PORT": str(grammar_port)})
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.grammar_metrics_url = f"http://127.0.0.1:{grammar_port}/metrics"
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

    def compile_all(self, schemas: list[str]) -> float:
        """Every schema compiled (one request each); the seconds it took."""
        started = time.monotonic()
        compile_all(self.stub, self.pb, schemas)
        return time.monotonic() - started

    def metrics(self) -> str:
        """The Prometheus scrape of the serving process."""
        return scrape(self.metrics_url)

    def grammar_metrics(self) -> str:
        """The Prometheus scrape of its grammar_service child ("" if it does not answer)."""
        try:
            return scrape(self.grammar_metrics_url)
        except OSError:
            return ""

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
                    # (a constrained request's budget holds the schema's shortest document)
                    stop=self.pb.StopConditions(max_tokens=96 if constrained else 4, ignore_eos=not constrained))
                if constrained:
                    request.json_schema = schema
                    request.constraint_options.compact = True
                for _ in self.stub.Generate(request, timeout=600):
                    pass
        return time.monotonic() - started


# ---- the plan -----------------------------------------------------------------------------------
def plan(shape: str, name: str, duration: float, warmup: float) -> dict:
    """idle TTFT prompt lengths, closed-loop (prompt, new tokens, concurrencies), the concurrencies
    whose closed loop runs constrained and free-matched beside free (`matched_at`; absent: every
    one), Poisson fractions, the prefix-caching workloads (`prefix`: a PrefixPlan, if any), the
    features' (`features`), the KV-cache budget of every arm's server in tokens (`kv_budget_tokens`)."""
    if name in ("fp8", "fp8-smoke"):  # the FP8 targets' workloads, run by each arm (--quantization, --kv-cache-dtype)
        prompt_len, new_tokens, concurrencies, matched_at = (
            (48, 64, [4], [4]) if name == "fp8-smoke" else (512, 128, [1, 64, 128, 256], [64]))
        # 3/4 of the largest loop's tokens at the base arm's KV dtype: too few pages for that loop
        # there, enough in e4m3 (2x the tokens in the same bytes)
        return {"idle": [], "closed": [(prompt_len, new_tokens, concurrencies)], "matched_at": matched_at,
                "poisson": [], "poisson_at": None,
                "kv_budget_tokens": 3 * max(concurrencies) * (prompt_len + new_tokens) // 4}
    if name in ("features", "features-smoke"):
        features = FEATURES_PLAN if name == "features" else FeaturesPlan(48, 16, 4, 1, 96, 4)
        return {"idle": [], "closed": [], "poisson": [], "poisson_at": None, "features": features}
    if name in ("http", "http-smoke"):  # the same server over gRPC and over HTTP, one after the other
        closed = [(48, 64, [4])] if name == "http-smoke" else [(512, 128, [64])]
        return {"idle": [], "closed": [], "http": closed, "poisson": [], "poisson_at": None}
    if name == "smoke":
        # (64 new tokens: the schema's shortest document fits, which a constrained request needs)
        return {"idle": [64], "closed": [(48, 64, [1, 4])], "poisson": [0.5], "poisson_at": (48, 64, 4),
                "prefix": PrefixPlan(256, 16, 64, 4, 64, 3, (48, 16, 4))}
    if name in ("constrained", "constrained-smoke"):  # issue 43's: constrained beside free-matched, users' traffic
        smoke = name == "constrained-smoke"
        concurrencies = [4] if smoke else [128] if shape == "qwen3-0.6b" else [1, 16, 64, 128, 256]
        group = (ConstrainedPlan(48, 160, 4, 8, 256) if smoke else CONSTRAINED_PLAN) if shape != "qwen3-0.6b" else None
        return {"idle": [1024, 4096, 8192] if shape == "llama-3.1-8b" else [],
                "closed": [(48, 160, concurrencies) if smoke else (512, 128, concurrencies)], "poisson": [],
                "poisson_at": None, "constrained": group}
    if name == "forced":
        return {"idle": [], "closed": [], "poisson": [], "poisson_at": None, "forced": FORCED_PLAN}
    if name == "targets" and shape != "llama-3.2-1b":  # the full plan's workloads with a target: no Poisson, no prefix
        return {"idle": [1024, 4096, 8192], "closed": [(512, 128, [1, 16, 64, 128, 256]), (2048, 128, [64]),
                                                       (512, 256, [64])], "poisson": [], "poisson_at": None}
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


def steady_window(args, roofline: dict | None, config, concurrency: int, prompt_len: int) -> dict:
    """A closed loop's warm-up and window: at least twice the first wave's prefill at the matmul
    rate each (the users start together, so a window shorter than that measures the start: 64
    users of 2,048 tokens take ~2.6 s of 8B prefill before any decodes), else --warmup/--duration."""
    if not roofline:
        return dict(duration_s=args.duration, warmup_s=args.warmup)
    from benchmarks._roofline import prefill_flops
    wave_s = concurrency * prefill_flops(config, prompt_len) / (roofline["matmul_tflops"] * 1e12)
    return dict(duration_s=max(args.duration, 2 * wave_s), warmup_s=max(args.warmup, 2 * wave_s))


def run_shape(shape: str, args, tokenizer_dir: pathlib.Path, tmp: pathlib.Path, save, arm: Arm) -> dict:
    """Roofline, server, workloads of one shape, all with `arm`'s flags (workloads named with its
    suffix); `save(result)` after every workload (a run cut short keeps what it measured)."""
    from generation_service.model.loader import read_config
    p = plan(shape, args.plan, args.duration, args.warmup)
    if args.concurrencies:  # a shorter run of the plan's closed loops
        p["closed"] = [(prompt_len, new_tokens, args.concurrencies) for prompt_len, new_tokens, _ in p["closed"]]
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
    group: ConstrainedPlan | None = p.get("constrained")
    concurrencies = sorted({c for _, _, cs in p["closed"] + p.get("http", []) for c in cs} | {1}
                           | ({prefix.concurrency, prefix.unshared[2]} if prefix else set())
                           | ({features.concurrency + 3 * features.feature_concurrency} if features else set())
                           | ({group.concurrency} if group else set()))
    max_batch = max(concurrencies + [args.min_max_batch])
    roofline = None
    points = sorted({f"{c}:{int(pl + n / 2)}" for pl, n, cs in p["closed"] + p.get("http", []) for c in cs}
                    | {f"1:{pl}" for pl in p["idle"]})  # idle TTFT: one decode step after the prompt
    # the mixed step of a loaded closed loop: half, three quarters, all but one of its rows decoding
    # beside a prompt chunk of MIXED_CHUNK_TOKENS, the GPU's part of what the engine's mixed steps took
    mixed_points = sorted({f"{d}:{int(pl + n / 2)}:{MIXED_CHUNK_TOKENS}" for pl, n, cs in p["closed"] for c in cs
                           if c >= 64 for d in (c // 2, 3 * c // 4, c - 1)})
    if args.device == "cuda" and points:
        out = tmp / f"roofline-{shape}-{arm.name}.json"
        log(f"{shape} {arm.name}: roofline (decode graph at batch:context {points})")
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "_roofline.py"), "--config",
                        str(folder / "config.json"), "--points", *points, "--mixed-points", *mixed_points,
                        "--max-batch", str(max_batch), "--out", str(out),
                        "--tensor-parallel", str(args.tensor_parallel), *arm.flags], check=True, cwd=ROOT)
        roofline = json.loads(out.read_text())
    flags = (*arm.flags, *kv_budget_flags(config, p.get("kv_budget_tokens"), args.device))
    log(f"{shape} {arm.name}: starting the server {' '.join(flags)}")
    server = Server(model, args, tmp / f"server-{shape}-{arm.name}.log", max_batch, http=bool(p.get("http")),
                    extra=flags)
    log(f"{shape}: listening at {server.address} after {server.startup_s:.1f} s")
    result = {"shape": shape, "model": model, "arm": arm.name, "server_flags": list(flags),
              "server_command": server.command, "server_startup_s": server.startup_s,
              "model_info": server.model_info(), "num_kv_pages_total": int(server.stats()["num_kv_pages_total"]),
              "roofline": roofline, "workloads": []}
    lengths = set(p["idle"]) | {pl for pl, _, _ in p["closed"] + p.get("http", [])}
    if p.get("forced"):
        lengths.add(p["forced"][0])
    if prefix:
        lengths |= {prefix.shared_len, prefix.tail_len, prefix.turn_prompt_len, prefix.unshared[0]}
    if features:
        lengths.add(features.prompt_len)
    if group:
        lengths.add(group.prompt_len)
    prompts = make_prompts(str(folder / "tokenizer.json"), lengths, 64, seed=1)
    schema = json.dumps(SCHEMA)
    warm_prompts = [prompts[n][0][::-1] for n in sorted(prompts)]  # reversed: no prefix a workload's prompts share
    try:
        log(f"{shape}: warm-up, {len(warm_prompts)} prompt lengths, free and constrained: "
            f"{server.warm(warm_prompts, schema):.1f} s")
    except BaseException:  # (the workloads' own try stops it later)
        server.stop()
        raise
    common = dict(duration_s=args.duration, warmup_s=args.warmup)
    lengths: dict[str, list[int]] = {}

    def run(workload: Workload, roof: float | None = None, on: Server | None = None,
            prompt_set: list[list[int]] | None = None) -> dict:
        on = on or server
        on.wait_idle()
        before, scraped, grammar_scraped = on.stats(), on.metrics(), on.grammar_metrics()
        address = on.http_url if workload.transport == "http" else on.address
        profilers = profile_server(args, on, shape, workload)
        client_cpu: list[float] = []
        records = run_workload(address, workload, prompt_set or prompts[workload.prompt_len], args.client_procs,
                               salt=len(result["workloads"]) << 30,  # request numbers apart from every other run's
                               client_cpu=client_cpu)
        summary = summarize(workload, records) | {"name": workload.name + arm.suffix, "arm": arm.name}
        summary["client_cpu_max"] = round(max(client_cpu), 3) if client_cpu else None
        for process, profiler in profilers.items():
            profiler.wait(timeout=60)
            summary.setdefault("profile", {})[process] = profile_summary(
                pathlib.Path(profiler.args[profiler.args.index("--output") + 1]),
                workload.warmup_s + workload.duration_s + 3)
        lengths[workload.name] = output_lengths(records)
        summary["engine"] = step_delta(before, on.wait_idle(), workload.warmup_s + workload.duration_s
                                       if not workload.num_requests else 0)
        after = on.metrics()
        summary["engine"]["num_preemptions"] = counter_delta(scraped, after, "structgen_preemptions")
        summary["server_mean_s"] = timing_means(scraped, after)
        summary["grammar_steps"] = grammar_step_delta(grammar_scraped, on.grammar_metrics())
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
        before, scraped = server.stats(), server.metrics()
        runs = [(w, ps, args.client_procs if i == 0 else 1) for i, (w, ps) in enumerate(workloads)]
        records = run_workloads(server.address, runs, salt=len(result["workloads"]) << 30)
        engine = step_delta(before, server.wait_idle(), workloads[0][0].warmup_s + workloads[0][0].duration_s)
        after = server.metrics()
        engine.update(num_preemptions=counter_delta(scraped, after, "structgen_preemptions"),
                      server_mean_s=timing_means(scraped, after))
        summaries = []
        for (workload, _), these in zip(workloads, records):
            summaries.append(summarize(workload, these) | {"name": workload.name + arm.suffix, "arm": arm.name,
                                                           "engine": engine})
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
                window = steady_window(args, roofline, config, c, prompt_len)
                free = run(Workload(f"free {tag}", prompt_len, new_tokens, concurrency=c, **window), roof)
                if args.repeats > 1:
                    runs = [free] + [run(Workload(f"free {tag} #{k}", prompt_len, new_tokens, concurrency=c, **window),
                                         roof) for k in range(2, args.repeats + 1)]
                    free["runs"] = [{"output_tokens_per_s": r["output_tokens_per_s"],
                                     "over_roofline": r.get("over_roofline")} for r in runs]
                    if roof:
                        free["over_roofline_median"] = statistics.median(r["over_roofline"] or 0 for r in runs)
                        log(f"  free {tag} over {args.repeats} runs: x{free['over_roofline_median']:.3f} roofline, "
                            f"median (" + ", ".join(f"{r['over_roofline'] or 0:.3f}" for r in runs) + ")")
                    save(result)
                if c == 1 and roofline and roofline.get("weight_read_floor_ms") and free["itl_p50_ms"]:
                    free["step_over_weight_floor"] = free["itl_p50_ms"] / roofline["weight_read_floor_ms"]
                    log(f"  batch-1 step (ITL p50) over the per-GPU weight-read floor "
                        f"{roofline['weight_read_floor_ms']:.2f} ms: x{free['step_over_weight_floor']:.2f}")
                if c not in p.get("matched_at", [c]):
                    continue
                constrained = run(Workload(f"constrained {tag}", prompt_len, new_tokens, concurrency=c,
                                           json_schema=schema, ignore_eos=False, **window))
                if roofline and constrained["mean_output_len"]:
                    n = constrained["mean_output_len"]
                    constrained["roofline_tokens_per_s"] = roofline_tok_s(roofline, config, c, prompt_len, n)
                    constrained["over_roofline"] = constrained["output_tokens_per_s"] / constrained["roofline_tokens_per_s"]
                matched = run(Workload(f"free-matched {tag}", prompt_len, new_tokens, concurrency=c,
                                       max_tokens_list=lengths[f"constrained {tag}"] or [new_tokens], **window),
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
            ref = next(w for w in result["workloads"]
                       if w["name"] == f"free {prompt_len}/{new_tokens} c={c}{arm.suffix}")
            for fraction in p["poisson"]:
                rate = fraction * ref["requests_per_s"]
                s = run(Workload(f"poisson {prompt_len}/{new_tokens} {fraction:.2f}x ({rate:.1f} req/s)", prompt_len,
                                 new_tokens, rate=rate, **common))
                s["offered_tokens_per_s"] = rate * new_tokens
        cached = prefix_workloads(prefix, prompts, schema, common, lambda w, ps: run(w, prompt_set=ps),
                                  "cache on") if prefix else None
        if p.get("forced"):
            result["forced_drafts"] = forced_workloads(*p["forced"], prompts, common, run)
        if group:
            from tokenizers import Tokenizer
            decode = Tokenizer.from_file(str(folder / "tokenizer.json")).decode
            corpus = json.loads(pathlib.Path(args.corpus_schemas).read_text()) if args.corpus_schemas else []
            single = next((w for w in result["workloads"] if w["name"] == (
                f"constrained {group.prompt_len}/{group.new_tokens} c={group.concurrency}{arm.suffix}")), None)
            result["constrained"] = constrained_workloads(
                group, prompts[group.prompt_len], [decode(ids) for ids in prompts[group.prompt_len]], schema, corpus,
                common, lambda w, ps: run(w, prompt_set=ps), lengths, server, single)
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
        log(f"{shape} {arm.name}: starting the server without prefix caching")
        off = Server(model, args, tmp / f"server-{shape}-{arm.name}-no-prefix-cache.log", max_batch,
                     extra=("--prefix-caching", "false", *flags))
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "llama-3.2-1b"],
                        help="preset shapes (random weights), or 'tiny-random' (the built-in random-weight model, CPU smoke)")
    parser.add_argument("--plan", choices=PLANS, default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per workload")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before the window opens")
    parser.add_argument("--client-procs", type=int, default=4)
    parser.add_argument("--concurrencies", type=int, nargs="*", default=[],
                        help="the closed loops at these concurrencies instead of the plan's")
    parser.add_argument("--repeats", type=int, default=1, help="run each closed loop's free workload this many times")
    parser.add_argument("--min-max-batch", type=int, default=1, help="the server's --max-batch at least this")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="the server's --tensor-parallel: GPUs the model is sharded over")
    parser.add_argument("--profile", default="", help="py-spy the server through workloads whose name holds this")
    parser.add_argument("--profile-mode", choices=("gil", "wall"), default="gil",
                        help="--profile samples the GIL holder, or every thread's wall time")
    parser.add_argument("--corpus-schemas", default="",
                        help="--plan constrained: a JSON list of schemas for per-request schemas "
                             "(benchmarks/_serve_constrained.py writes it)")
    parser.add_argument("--quantization", choices=("fp8",), default=None,
                        help="a second arm: every workload again on a server (and roofline) with this --quantization")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="a second arm (with --quantization: the same one) with this --kv-cache-dtype")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more `structgen serve` flags")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from tests.real_tokenizers import tokenizer_dir
    tok = pathlib.Path(os.environ.get("STRUCTGEN_TEKKEN_DIR") or tokenizer_dir("tekken_131k"))
    result = {"benchmark": "serve", "command": command_line(pathlib.Path(sys.argv[0]).name),
              "code_commit": code_commit(), "python": platform.python_version(), "client_procs": args.client_procs,
              "plan": args.plan, "tensor_parallel": args.tensor_parallel, "duration_s": args.duration, "warmup_s": args.warmup,
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "host_python_ms": host_python_ms(), "shapes": []}
    if args.device == "cuda":
        import torch
        result.update(device=torch.cuda.get_device_name(), torch=torch.__version__, cpus=os.cpu_count())
    with tempfile.TemporaryDirectory(prefix="structgen-serve-bench-") as tmp:
        for shape in args.shapes:
            done, arms_done = list(result["shapes"]), []

            def save(partial: dict | None) -> None:
                result["shapes"] = done + [join_arms(arms_done + ([partial] if partial else []))]
                write_result(args.out, result)
            for arm in serve_arms(args.device, args.quantization, args.kv_cache_dtype):
                arms_done.append(run_shape(shape, args, tok, pathlib.Path(tmp), save, arm))
            save(None)
            for name, ratios in result["shapes"][-1].get("over_base", {}).items():
                log(ratio_line(name, ratios))
    log("done: " + args.out)
    for shape in result["shapes"]:
        print(f"== {shape['shape']}")
        for s in shape["workloads"]:
            print(line(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
