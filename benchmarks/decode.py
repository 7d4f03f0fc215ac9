"""Decode throughput on the GPU: free vs JSON-Schema constrained, against the weight-read
floor and against transformers generate() + xgrammar's logits processor (issue 6, point 5).

    python benchmarks/decode.py --out benchmarks/results/decode-h200.json

What is measured (per model shape, per batch size), all graphs of one runner:
- free:        the `free` decode graph (no channel work), tokens/s and ms/step;
- constrained: the `wait_*` graphs (mask prefetch: wait + gather on a side stream while the
               forward runs, the serving default) with grammar_service (the real StepLoop,
               xgrammar, Tekken-131k tokenizer) in its own process filling every row's mask
               through the step channel; rows that finish their JSON document are re-bound
               (FRESH) so every row stays constrained;
- constrained_serial: the same with the `+serial` graphs (wait and gather after the forward,
               one stream: the step before mask prefetch);
- nowait:      the mask gather/apply and outputs writes (prefetched) without the wait and
               without the sequence words;
- prepublished: the whole channel mechanism of `constrained` (inputs_seq, wait node, gather,
               outputs, outputs_seq; grammar_service sees every step) with a wait that always
               passes and free rows in the descriptors: the step if masks were always ready.
               wait_fraction = 1 - prepublished / constrained = the GPU's time waiting for
               grammar_service; wait_plus_mechanism_fraction = 1 - nowait / constrained (an
               upper bound on the wait: it also holds the wait node and the seq writes);
- engine:      the whole Engine with runner "cuda_graph" (scheduler, streams, host loop),
               overlap off and on (`EngineConfig.overlap`), free greedy decode of random
               prompts and, with grammar_service over gRPC, the same batch constrained by
               SCHEMA; its ms/step against `free` is the host's share;
- floor:       weights read per step (every parameter but an untied input embedding, of
               which only B rows are read) / device copy bandwidth measured in this run;
               also weights + KV read.
Decode starts from a KV cache filled with random values at `--context` tokens per row (no
prefill is timed). Random weights, bf16, vocab 131072; greedy sampling (mask_sample).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._engine_batch import run_batch  # noqa: E402
from benchmarks._gpu_model import (  # noqa: E402
    load_rows, pages_per_row, preset_shape, projection_inputs, random_kv_cache, random_model,
)
from benchmarks._gpu_timing import copy_bandwidth_gbs, graph_ms, weight_bytes_read  # noqa: E402
from benchmarks._harness import (  # noqa: E402
    PAGE_SIZE, VOCAB, command_line, engine_model_spec, log, tekken_dir, utc_now, write_result,
)
from generation_service.engine.cuda_graphs import (  # noqa: E402
    FREE, NOWAIT, PREPUBLISHED, WAIT_EVEN, WAIT_ODD, with_serial,
)
from generation_service.engine.gpu_runner import GpuDecodeRunner  # noqa: E402
from generation_service.engine.kv_cache import KVCache  # noqa: E402
from generation_service.model.presets import PRESETS  # noqa: E402
from step_channel import FLAG_CONSTRAINED, FLAG_FRESH, Geometry, StepChannel  # noqa: E402
from step_channel.cuda import MappedChannel  # noqa: E402
# grammar_service over gRPC for the engine rows, as the engine tests start it
from tests.integration.test_engine_support import (  # noqa: E402
    start_grammar_service as start_grammar_service_grpc,
)

from hf_baseline import hf_baseline  # noqa: E402  (benchmarks/, the script's folder)

# The host writes descriptor n once grammar_service is done with step n - D + 1; a sleeping host
# (wait_seq's 1 ms steps) could launch step n after the GPU drained its queue, a bubble only the
# waiting modes would pay, so the harness spins (at 1B a short spin and then sleeps measured the
# same: benchmarks/results/decode-h200-1b-b8wait-hostsleep.json against decode-h200-1b-b8wait-base.json).
HOST_WAIT_SPIN_US = 20000.0
# GpuDecodeRunner switches the command line can set (each --flag of the same name; None: the
# runner's default), read at capture: A/B of the step's channel work in one run. name: (type, help)
RUNNER_SETTINGS = {
    "prefetch_min_bucket": (int, "buckets below it fork the mask read at the LM head (or read after "
                                 "the forward); 1 = the side-stream prefetch from the step's start everywhere"),
    "fold_step_tail": (bool, "the epilogue publishes outputs_seq and advances N; --no-fold-step-tail: the "
                             "write memop + 3 kernels after it"),
    "ring_mask_read": (bool, "masks read after the forward: mask_sample reads the mapped ring entry in place "
                             "instead of a gather kernel first"),
    "mask_gather_programs": (int, "CTAs of the side stream's mask gather; 0: torch.index_select"),
    "fold_inputs_seq": (bool, "the forward's prologue publishes inputs_seq; --no-fold-inputs-seq: a write "
                              "memop + a copy kernel before it"),
    "prefetch_at_head": (bool, "below prefetch_min_bucket the prefetch variants fork the mask wait + gather "
                               "at the LM head"),
}
SCHEMA = {  # a typical extraction schema: strings, numbers, enums, a nested array
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "email": {"type": "string"}, "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "active", "role", "tags", "address"],
}


WAIT_STAMP_SLOTS = 8192  # --wait-stamps: steps of one mode's run the ring holds


def wait_stamps_summary(stamps: torch.Tensor, first: int, end: int) -> dict:
    """Channel steps [first, end): the GPU's time from before to after its mask wait, in us
    (`GpuDecodeRunner.wait_stamps`; it includes the second stamp's launch): percentiles, mean,
    and the share of steps over 10 us."""
    assert 0 < end - first <= stamps.shape[0], "more steps than the stamp ring holds"
    slots = torch.arange(first, end) % stamps.shape[0]
    t = stamps.cpu()[slots]
    us = sorted(((t[:, 1] - t[:, 0]).double() / 1e3).tolist())
    at = lambda q: us[min(len(us) - 1, int(q * len(us)))]  # noqa: E731
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": us[-1], "mean": sum(us) / len(us),
            "over_10us": sum(u > 10 for u in us) / len(us)}


class Bench:
    def __init__(self, args, mapped: MappedChannel, grammar_id: int):
        self.args, self.mapped, self.chan, self.grammar_id = args, mapped, mapped.channel, grammar_id
        self.depth = self.chan.geometry.depth

    MODES = ("free", "nowait", "prepublished", "constrained", "constrained_serial")

    def run(self, runner, batch: int, mode: str, num_steps: int) -> dict:
        """Time num_steps steps after warmup; mode: one of MODES."""
        load_rows(runner, batch, self.args.context, self.num_row_pages)
        fresh = set(range(batch))
        channel_step = mode in ("prepublished", "constrained", "constrained_serial")
        for i in range(self.args.warmup + num_steps):
            if i == self.args.warmup:
                torch.cuda.synchronize()
                start, first_step = time.perf_counter(), runner.next_channel_step
            if channel_step:
                # prepublished: free rows (grammar_service fills all-ones masks, advances nothing)
                self._describe(runner.next_channel_step, batch, fresh, constrained=mode != "prepublished")
            if mode == "prepublished":
                runner.step(batch, variant=PREPUBLISHED)
            else:
                runner.step(batch, constrained=mode != "free", wait=channel_step,
                            prefetch=mode != "constrained_serial")
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if mode == "prepublished":
            # NOTE: the parity wait of the next waiting step N needs mask_seq in {N-1, N}; the
            # prepublished steps did not wait, so grammar_service may still be behind: let it
            # catch up to the last step before any parity wait is replayed.
            last = runner.next_channel_step - 1
            if not self.chan.wait_seq("mask_seq", last, timeout_s=60):
                raise TimeoutError(f"grammar_service stuck before step {last}")
        step_ms = elapsed / num_steps * 1e3
        out = {"batch": batch, "mode": mode, "steps": num_steps, "ms_per_step": step_ms,
               "tokens_per_s": batch * num_steps / elapsed}
        if runner.wait_stamps is not None and channel_step:
            out["wait_stamps_us"] = wait_stamps_summary(runner.wait_stamps, first_step, runner.next_channel_step)
        return out

    def _describe(self, n: int, batch: int, fresh: set[int], constrained: bool = True) -> None:
        """Descriptor of channel step n; throttled so entry n % D is free to rewrite (also when
        the GPU does not wait: prepublished steps run at most D-1 steps ahead of mask_seq).
        constrained=False: free rows (no matcher advanced, bound or re-bound; the rows of a
        later constrained run start FRESH anyway)."""
        chan = self.chan
        oldest = n - self.depth + 1  # grammar_service must be done with it (it reads desc n-D)
        if oldest >= self.first_step:
            if not chan.wait_seq("mask_seq", oldest, timeout_s=60, spin_s=self.args.host_wait_spin_us / 1e6):
                raise TimeoutError(f"grammar_service stuck before step {oldest}")
        if oldest >= self.first_step and constrained:
            # rows whose document ended at step oldest-1 get a fresh matcher (results of free
            # rows are (-1, 0): grammar_service resets them)
            results = chan.entry(oldest).results
            prev_batch = chan.entry(oldest - 1).batch_size if oldest - 1 >= self.first_step else 0
            for r in range(min(prev_batch, batch)):
                if results[r, 0] >= 0 or results[r, 1] != 0:
                    fresh.add(r)
                    self.num_rebinds += 1
                    self.num_errors += int(results[r, 1] != 0)
        e = chan.entry(n)
        e.desc_header[:] = (n, batch)
        rows = e.desc_rows
        rows[:batch, 0] = range(batch)
        rows[:batch, 1] = 1
        rows[:batch, 2] = FLAG_CONSTRAINED if constrained else 0
        rows[:batch, 3] = self.grammar_id
        if constrained:
            for r in fresh:
                rows[r, 2] = FLAG_CONSTRAINED | FLAG_FRESH
            fresh.clear()

    def diagnostics(self, model, kv, runner) -> dict:
        """Where the step time goes beyond the floor, at the smallest and largest bucket:
        - gemm_only_ms: every projection and the LM head of one step with the real weights, alone
          (what cuBLAS achieves on the weight read);
        - free_unfused_ms: the v1 forward (torch element-wise ops), same run, for comparison."""
        import torch.nn.functional as F
        cfg, out = model.config, {}
        for bucket in (min(self.args.batches), max(self.args.batches)):
            x, xq, xi = projection_inputs(cfg, bucket)

            def chain():
                for w, layer in zip(runner.forward.weights, model.model.layers):
                    F.linear(x, w.qkv)
                    layer.self_attn.o_proj(xq)
                    F.linear(x, w.gate_up)
                    layer.mlp.down_proj(xi)
                F.linear(x, model.output_weight)
            gemm_ms = graph_ms(chain)
            out[f"b{bucket}_gemm_only_ms"] = gemm_ms
            out[f"b{bucket}_gemm_only_gbs"] = weight_bytes_read(model) / (gemm_ms / 1e3) / 1e9
            log(f"{cfg.num_layers}-layer model b={bucket}: GEMMs alone {gemm_ms:.3f} ms "
                f"({out[f'b{bucket}_gemm_only_gbs']:.0f} GB/s of weights)")
        unfused = GpuDecodeRunner(model, kv, max_batch=1, buckets=(1,), fused_ops=False, variants=(FREE,))
        unfused.capture()
        res = self.run(unfused, 1, "free", self.args.steps)
        unfused.close()
        out["b1_free_unfused_ms"] = res["ms_per_step"]
        log(f"b=1 free, unfused v1 forward: {res['ms_per_step']:.3f} ms/step")
        return out

    def model_shape(self, preset: str) -> dict:
        args = self.args
        cfg = preset_shape(preset)
        log(f"{preset}: building random weights")
        model = random_model(cfg)
        max_batch = max(args.batches)
        self.num_row_pages = pages_per_row(args.context + args.warmup + args.steps * 3 + 8)
        kv = random_kv_cache(cfg, 1 + max_batch * self.num_row_pages)
        # prefetch (default) and +serial waiting pairs, nowait, prepublished: 7 graphs per bucket
        runner = GpuDecodeRunner(model, kv, max_batch=max_batch, buckets=tuple(args.batches),
                                 mapped=self.mapped, variants=(FREE, WAIT_EVEN, WAIT_ODD, NOWAIT, PREPUBLISHED,
                                                               with_serial(WAIT_EVEN), with_serial(WAIT_ODD)))
        runner.set_channel_step(self.next_step)
        for key in RUNNER_SETTINGS:  # read at capture
            if getattr(self.args, key) is not None:
                setattr(runner, key, getattr(self.args, key))
        if self.args.wait_stamps:
            runner.wait_stamps = torch.zeros(WAIT_STAMP_SLOTS, 2, dtype=torch.int64, device="cuda")
        with torch.no_grad():
            capture_s = runner.capture()
            log(f"{preset}: captured {len(runner.graphs.graphs)} graphs in {capture_s:.1f} s")
            wbytes = weight_bytes_read(model)
            kv_token_bytes = KVCache.bytes_per_page(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim,
                                                    torch.bfloat16)
            rows = []
            for batch in args.batches:
                for mode in self.MODES:
                    try:
                        res = self.run(runner, batch, mode, args.steps)
                    except BaseException:
                        # NOTE: release a GPU that may wait for masks, or teardown would hang.
                        self.chan.publish_seq("mask_seq", runner.next_channel_step - 1)
                        raise
                    mean_ctx = args.context + args.warmup + args.steps / 2
                    floor_ms = wbytes / (self.bw * 1e9) * 1e3
                    kv_ms = batch * mean_ctx * kv_token_bytes / (self.bw * 1e9) * 1e3
                    res.update(weight_floor_ms=floor_ms, weight_kv_floor_ms=floor_ms + kv_ms,
                               over_weight_floor=res["ms_per_step"] / floor_ms,
                               over_weight_kv_floor=res["ms_per_step"] / (floor_ms + kv_ms))
                    rows.append(res)
                    log(f"{preset} b={batch:3d} {mode:18s} {res['ms_per_step']:7.3f} ms/step "
                        f"{res['tokens_per_s']:9.1f} tok/s  x{res['over_weight_floor']:.2f} weight floor")
                    if "wait_stamps_us" in res:
                        log(f"{preset} b={batch:3d} {mode:18s} wait node (us): " + ", ".join(
                            f"{k} {v:.3f}" if k == "over_10us" else f"{k} {v:.1f}"
                            for k, v in res["wait_stamps_us"].items()))
                by = {r["mode"]: r for r in rows if r["batch"] == batch}
                c, c_ms = by["constrained"], by["constrained"]["ms_per_step"]
                c["wait_fraction"] = max(0.0, 1 - by["prepublished"]["ms_per_step"] / c_ms)
                c["wait_plus_mechanism_fraction"] = max(0.0, 1 - by["nowait"]["ms_per_step"] / c_ms)
                c["constrained_over_free"] = c["tokens_per_s"] / by["free"]["tokens_per_s"]
                c["constrained_serial_over_free"] = (
                    by["constrained_serial"]["tokens_per_s"] / by["free"]["tokens_per_s"])
                c["prefetch_gain"] = by["constrained_serial"]["ms_per_step"] / c_ms - 1
            try:  # diagnostics must not lose the main numbers
                diagnostics = self.diagnostics(model, kv, runner)
            except Exception as exc:  # noqa: BLE001
                log(f"{preset}: diagnostics failed: {exc!r}")
                diagnostics = {"error": repr(exc)}
        self.next_step = runner.next_channel_step
        # NOTE: teardown order -- graphs before the channel is unregistered (main does that).
        runner.close()
        out = {"preset": preset, "sampler": runner.sampler, "weight_bytes_read": wbytes, "num_parameters": cfg.num_parameters,
               "capture_s": capture_s, "variants": [v.name for v in runner.variants], "rows": rows,
               "diagnostics": diagnostics}
        del runner, model, kv
        torch.cuda.empty_cache()
        return out


def engine_decode(preset: str, batches: list[int], context: int, new_tokens: int, overlap: bool,
                  model_spec: str, grammar_address: str | None) -> list[dict]:
    """The whole Engine (scheduler, streams, runner "cuda_graph", `overlap` off or on): greedy
    decode of random prompts, free and (with grammar_service at `grammar_address`) every row
    constrained by SCHEMA: graph step + the host loop around it."""
    from generation_service.engine.engine import Engine, EngineConfig
    from grammar_contract.spec import GrammarSpec
    max_batch = max(batches)
    num_row_pages = pages_per_row(context + new_tokens + 8)
    client = None
    if grammar_address is not None:
        from grammar_contract.client import GrammarControlClient
        client = GrammarControlClient(grammar_address)
    engine = Engine(EngineConfig(model=model_spec, device="cuda", dtype="bfloat16", runner="cuda_graph",
                                 max_batch=max_batch, num_pages=1 + max_batch * num_row_pages,
                                 page_size=PAGE_SIZE, max_prompt_tokens=context, max_new_tokens_limit=new_tokens,
                                 prefill_chunk_tokens=max(512, context * max_batch), overlap=overlap), client)
    engine.start()
    rows = []
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False)
    try:
        gen = torch.Generator().manual_seed(0)
        vocab = engine.model_config.vocab_size
        for batch in batches:
            for mode in ("free", "constrained") if client is not None else ("free",):
                try:
                    rows.append(_engine_run(engine, preset, batch, mode, context, new_tokens, overlap, gen, vocab,
                                            grammar if mode == "constrained" else None))
                except Exception as exc:  # noqa: BLE001 -- one mode's failure must not lose the others
                    log(f"engine {preset} b={batch} overlap={overlap} {mode} failed: {exc!r}")
                    rows.append({"preset": preset, "batch": batch, "mode": mode, "overlap": overlap,
                                 "error": repr(exc)})
                    if mode == "free":
                        raise
    finally:
        engine.stop()
        if client is not None:
            client.close()
    return rows


def _engine_run(engine, preset: str, batch: int, mode: str, context: int, new_tokens: int, overlap: bool,
                gen: torch.Generator, vocab: int, grammar) -> dict:
    """One batch through the engine (`run_batch`: timed from every row's first token to the last
    row's end). Constrained rows stop at the end of their document (GRAMMAR_COMPLETE) or at
    new_tokens, so tokens/s counts the tokens received, ms/step the engine steps taken."""
    from generation_service.engine.params import SamplingParams
    prompts = [tuple(torch.randint(0, vocab, (context,), generator=gen).tolist()) for _ in range(batch)]
    run = run_batch(engine, f"{preset}-{mode}-{overlap}-{batch}", prompts,
                    SamplingParams(max_new_tokens=new_tokens, ignore_eos=grammar is None), grammar=grammar,
                    timeout_s=300)
    w, steps = run.window, run.window.steps
    row = {"preset": preset, "batch": batch, "mode": mode, "overlap": overlap, "runner": "cuda_graph",
           "steps": steps, "graph_steps": w.graph_steps, "chained_steps": w.chained_steps,
           "ms_per_step": run.window_s / max(1, steps) * 1e3, "tokens_per_s": run.num_decoded / run.window_s,
           "tokens_decoded": run.num_decoded, "finish_reasons": run.finish_reasons, "errors": run.errors,
           "vocab_size": vocab}
    log(f"engine {preset} b={batch:3d} overlap={overlap!s:5s} {mode:11s} {row['ms_per_step']:8.3f} ms/step "
        f"{row['tokens_per_s']:9.1f} tok/s ({row['graph_steps']}/{steps} graph steps, "
        f"{row['chained_steps']} chained, {run.finish_reasons})")
    return row


def start_grammar_service(chan: StepChannel, tokenizer_dir: str, max_slots: int, tmp: pathlib.Path,
                          fill_threads: int = 0, config: dict | None = None):
    schema = tmp / "bench_schema.json"
    schema.write_text(json.dumps(SCHEMA))
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/gpu/grammar_proc.py"), chan.name, tokenizer_dir,
                             str(VOCAB), str(max_slots), "1", str(schema), str(fill_threads),
                             json.dumps(config or {})],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = json.loads(proc.stdout.readline())
    return proc, ready["grammar_id"], ready.get("backend", "?")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["llama-3.1-8b", "llama-3.2-1b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 128])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--hf-batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--hf-new-tokens", type=int, default=24)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--engine-batches", nargs="*", type=int, default=[1, 32],
                    help="Engine(runner='cuda_graph') end to end, free; none: skip")
    ap.add_argument("--engine-new-tokens", type=int, default=64)
    ap.add_argument("--skip-engine-constrained", action="store_true",
                    help="engine rows free only (no grammar_service over gRPC)")
    ap.add_argument("--tokenizer-dir", default=tekken_dir())
    ap.add_argument("--grammar-fill-threads", type=int, default=0,
                    help="grammar_service's mask-fill threads for the graph rows (0: its default)")
    ap.add_argument("--grammar-config", type=json.loads, default={},
                    help="further GrammarServiceConfig fields for grammar_service, as a JSON object")
    ap.add_argument("--host-wait-spin-us", type=float, default=HOST_WAIT_SPIN_US,
                    help="how long the host spins on mask_seq before it writes a descriptor D steps "
                         "ahead, before sleeping up to 1 ms (50: a short spin, then sleeps)")
    for name, (kind, text) in RUNNER_SETTINGS.items():
        kwargs = dict(action=argparse.BooleanOptionalAction) if kind is bool else dict(type=kind)
        ap.add_argument("--" + name.replace("_", "-"), default=None,
                        help=f"GpuDecodeRunner.{name} (default: the runner's): {text}", **kwargs)
    ap.add_argument("--wait-stamps", action="store_true",
                    help="GPU timestamps around every channel step's mask wait (two kernels more a step): "
                         "per-step wait percentiles in each channel mode's row (wait_stamps_us)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/decode-h200.json"))
    args = ap.parse_args()
    args.batches = sorted(args.batches)
    torch.manual_seed(0)
    result = {"command": command_line(f"python {sys.argv[0]}"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "started": utc_now(),
              "mask_source": "grammar_service StepLoop (xgrammar) in its own process, through the step channel",
              "schema": SCHEMA, "context_tokens": args.context}
    bw = copy_bandwidth_gbs()
    result["copy_bandwidth_gbs"] = bw
    log(f"device copy bandwidth {bw:.0f} GB/s (read + write)")
    geometry = Geometry(max_batch=max(args.batches), max_positions=1, vocab_size=VOCAB, depth=4)
    chan = StepChannel.create(geometry)
    mapped = MappedChannel.register(chan)
    tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    proc, grammar_id, backend = start_grammar_service(chan, args.tokenizer_dir, max(args.batches), tmp,
                                                      args.grammar_fill_threads, args.grammar_config)
    result["mask_source"] = result["mask_source"].replace("(xgrammar)", f"({backend})")
    result["grammar_fill_threads"] = args.grammar_fill_threads or "default (cores / 2)"
    result["grammar_config"] = args.grammar_config
    result["host_wait_spin_us"] = args.host_wait_spin_us
    bench = Bench(args, mapped, grammar_id)
    bench.bw, bench.first_step, bench.next_step, bench.num_rebinds, bench.num_errors = bw, 1, 1, 0, 0
    result["models"] = []
    try:
        for preset in args.presets:
            result["models"].append(bench.model_shape(preset))
    finally:
        torch.cuda.synchronize()
        proc.stdin.close()
        tail = proc.stdout.read().strip().splitlines()
        proc.wait(30)
        last = json.loads(tail[-1]) if tail else {}
        result["grammar_service_stats"] = last.get("stats")
        result["grammar_recent_step_us"] = last.get("recent_step_us")  # the last 1024 steps
        result["rebinds"], result["grammar_errors"] = bench.num_rebinds, bench.num_errors
        mapped.close()
        chan.close()
    if not args.skip_hf:
        result["hf_baseline"] = []
        for preset in args.presets:
            try:
                result["hf_baseline"] += hf_baseline(PRESETS[preset], preset, args.tokenizer_dir, SCHEMA,
                                                     args.hf_batches, args.hf_new_tokens, 128, log)
            except Exception as exc:  # the baseline must not lose the main numbers
                log(f"HF baseline {preset} failed: {exc!r}")
                result.setdefault("hf_errors", []).append(f"{preset}: {exc!r}")
    if args.engine_batches:
        result["engine"] = []
        grammar = None
        if not args.skip_engine_constrained:
            try:  # constrained engine rows need grammar_service over gRPC; free rows do not
                grammar = start_grammar_service_grpc(tmp, "bench_grammar")
            except Exception as exc:  # noqa: BLE001
                log(f"grammar_service (gRPC) failed to start, engine rows free only: {exc!r}")
                result.setdefault("engine_errors", []).append(f"grammar_service: {exc!r}")
        try:
            for preset in args.presets:
                spec = engine_model_spec(preset, args.tokenizer_dir, tmp / f"bench_model_{preset}")
                for overlap in (False, True):
                    torch.cuda.empty_cache()
                    try:
                        result["engine"] += engine_decode(preset, args.engine_batches, args.context,
                                                          args.engine_new_tokens, overlap, spec,
                                                          grammar.address if grammar and spec != f"random:{preset}"
                                                          else None)
                    except Exception as exc:  # noqa: BLE001 -- must not lose the main numbers
                        log(f"engine {preset} overlap={overlap} failed: {exc!r}")
                        result.setdefault("engine_errors", []).append(f"{preset} overlap={overlap}: {exc!r}")
        finally:
            if grammar is not None:
                grammar.stop()
    write_result(args.out, result)
    summary(result)
    return 0


def summary(result: dict) -> None:
    """c/f: constrained (prefetch) over free; serial: the same without prefetch; wait%: GPU time
    waiting for grammar_service (vs prepublished); +mech%: the wait plus the channel's own work (vs nowait)."""
    print(f"\ncopy bandwidth {result['copy_bandwidth_gbs']:.0f} GB/s; masks: {result['mask_source']}")
    print(f"{'model':14s} {'batch':>5s} {'free ms':>8s} {'nowait':>7s} {'prepub':>7s} {'constr':>7s} "
          f"{'serial':>7s} {'free tok/s':>10s} {'constr tok/s':>12s} {'c/f':>5s} {'serial':>6s} "
          f"{'wait%':>5s} {'+mech%':>6s} {'x floor':>7s}")
    for m in result["models"]:
        for batch in sorted({r["batch"] for r in m["rows"]}):
            by = {r["mode"]: r for r in m["rows"] if r["batch"] == batch}
            f, c = by["free"], by["constrained"]
            ms = [by[mode]["ms_per_step"] for mode in ("free", "nowait", "prepublished", "constrained",
                                                        "constrained_serial")]
            print(f"{m['preset']:14s} {batch:5d} {ms[0]:8.3f} {ms[1]:7.3f} {ms[2]:7.3f} {ms[3]:7.3f} {ms[4]:7.3f} "
                  f"{f['tokens_per_s']:10.1f} {c['tokens_per_s']:12.1f} {c['constrained_over_free']:5.3f} "
                  f"{c['constrained_serial_over_free']:6.3f} {100 * c['wait_fraction']:5.1f} "
                  f"{100 * c['wait_plus_mechanism_fraction']:6.1f} {f['over_weight_floor']:7.2f}")
    for e in result.get("engine", []):
        head = f"Engine {e['preset']:14s} b={e['batch']:3d} overlap={e['overlap']!s:5s} {e['mode']:11s}"
        if "error" in e:
            print(f"{head} error {e['error']}")
        else:
            print(f"{head} {e['ms_per_step']:8.3f} ms/step {e['tokens_per_s']:9.1f} tok/s "
                  f"({e['graph_steps']}/{e['steps']} graph, {e['chained_steps']} chained)")
    for h in result.get("hf_baseline", []):
        head = f"HF {h['preset']:14s} b={h['batch']:3d} {h['mode']:19s}"
        if "error" in h:
            print(f"{head} error {h['error'][:100]}")
        elif "min_processor_ms" in h:
            print(f"{head} transformers' min-length processors alone {h['min_processor_ms']:.2f} ms/step")
        else:
            print(f"{head} {h['tokens_per_s']:8.1f} tok/s {h['ms_per_step']:8.2f} ms/step")


if __name__ == "__main__":
    sys.exit(main())
