"""decode.py's graph rows: the decode graphs of one GpuDecodeRunner per model shape, timed per
batch in each mode of `Bench.MODES` (decode.py's docstring says what each is), with grammar_service
in its own process (tests/gpu/grammar_proc.py: the real StepLoop) filling masks through a mapped
step channel. `graph_rows` runs them all and puts the rows and grammar_service's statistics in the
result; `Bench.diagnostics` adds the GEMMs alone and the unfused forward at the ends of the batches.
Assumes decode.py has put the repository root on sys.path.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import torch

from benchmarks._gpu_model import (
    load_rows, pages_per_row, preset_shape, projection_inputs, random_kv_cache, random_model,
)
from benchmarks._gpu_timing import graph_ms, weight_bytes_read
from benchmarks._harness import ROOT, VOCAB, log
from generation_service.engine.cuda_graphs import (
    FREE, NOWAIT, PREPUBLISHED, WAIT_EVEN, WAIT_ODD, with_serial,
)
from generation_service.engine.gpu_runner import GpuDecodeRunner
from generation_service.engine.kv_cache import KVCache
from step_channel import FLAG_CONSTRAINED, FLAG_FRESH, Geometry, StepChannel
from step_channel.cuda import MappedChannel

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
    """The graph rows of each model shape over one step channel; `next_step` carries the channel's
    step numbering from one shape's runner to the next."""

    def __init__(self, args, mapped: MappedChannel, grammar_id: int, bandwidth_gbs: float):
        self.args, self.mapped, self.chan, self.grammar_id = args, mapped, mapped.channel, grammar_id
        self.depth = self.chan.geometry.depth
        self.bw, self.first_step, self.next_step, self.num_rebinds, self.num_errors = bandwidth_gbs, 1, 1, 0, 0

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
        # NOTE: teardown order -- graphs before the channel is unregistered (graph_rows does that).
        runner.close()
        out = {"preset": preset, "sampler": runner.sampler, "weight_bytes_read": wbytes, "num_parameters": cfg.num_parameters,
               "capture_s": capture_s, "variants": [v.name for v in runner.variants], "rows": rows,
               "diagnostics": diagnostics}
        del runner, model, kv
        torch.cuda.empty_cache()
        return out


def start_grammar_service(chan: StepChannel, tokenizer_dir: str, max_slots: int, schema: dict,
                          fill_threads: int = 0, config: dict | None = None):
    """grammar_service's StepLoop in its own process on `chan`, `schema` compiled: (the process,
    the schema's grammar id, the backend that compiled it)."""
    schema_path = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "bench_schema.json"
    schema_path.write_text(json.dumps(schema))
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/gpu/grammar_proc.py"), chan.name, tokenizer_dir,
                             str(VOCAB), str(max_slots), "1", str(schema_path), str(fill_threads),
                             json.dumps(config or {})],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = json.loads(proc.stdout.readline())
    return proc, ready["grammar_id"], ready.get("backend", "?")


def graph_rows(args, schema: dict, bandwidth_gbs: float, result: dict) -> None:
    """Every preset's graph rows into result["models"], grammar_service's figures beside them."""
    geometry = Geometry(max_batch=max(args.batches), max_positions=1, vocab_size=VOCAB, depth=4)
    chan = StepChannel.create(geometry)
    mapped = MappedChannel.register(chan)
    proc, grammar_id, backend = start_grammar_service(chan, args.tokenizer_dir, max(args.batches), schema,
                                                      args.grammar_fill_threads, args.grammar_config)
    result["mask_source"] = result["mask_source"].replace("(xgrammar)", f"({backend})")
    result["grammar_fill_threads"] = args.grammar_fill_threads or "default (cores / 2)"
    result["grammar_config"] = args.grammar_config
    result["host_wait_spin_us"] = args.host_wait_spin_us
    bench = Bench(args, mapped, grammar_id, bandwidth_gbs)
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
