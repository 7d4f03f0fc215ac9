"""benchmarks/serve.py's harness on CPU (the GPU run is the benchmark): the real `structgen serve`
with the built-in tiny-random model, client processes over gRPC, every workload of the smoke plan measured,
no call failed, the free-matched run replays the constrained run's output lengths, and the prefix
cache finds only the prefixes the prefix-caching workloads share (cache on and off)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.test_engine_support import ROOT

pytestmark = pytest.mark.slow


def test_serve_benchmark_runs_every_workload_on_cpu(tmp_path):
    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, "benchmarks/serve.py", "--device", "cpu", "--shapes", "tiny-random", "--plan", "smoke",
                    "--duration", "3", "--warmup", "1", "--client-procs", "2", "--repeats", "2", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=600, capture_output=True)
    result = json.loads(out.read_text())
    assert result["host_python_ms"] > 0  # the host's speed, beside host-bound figures
    shape = result["shapes"][0]
    names = [w["name"] for w in shape["workloads"]]
    prefix = [f"{kind} ({cache})" for cache in ("cache on", "cache off")
              for kind in ("shared-prefix 256+16/64 c=4", "multi-turn 64+3x(64+16) c=4", "unshared 48/16 c=4")]
    assert names == ["idle-ttft-64"] + [name for c in (1, 4) for name in (
        f"free 48/64 c={c}", f"free 48/64 c={c} #2", f"constrained 48/64 c={c}", f"free-matched 48/64 c={c}")] + [
        names[9]] + prefix
    assert names[9].startswith("poisson 48/64 0.50x")
    for w in shape["workloads"]:
        assert w["errors"] == {} and w["num_finished"] > 0, w
        assert w["num_requests"] == 3 or w["output_tokens_per_s"] > 0, w
    by = {w["name"]: w for w in shape["workloads"]}
    # --repeats 2: the free closed loop twice in a row, both runs listed on the first
    assert [r["output_tokens_per_s"] for r in by["free 48/64 c=4"]["runs"]] == [
        by[f"free 48/64 c=4{k}"]["output_tokens_per_s"] for k in ("", " #2")]
    for c in (1, 4):
        constrained, matched = by[f"constrained 48/64 c={c}"], by[f"free-matched 48/64 c={c}"]
        assert sum(constrained["validation"].values()) == constrained["num_finished"]  # every output checked
        assert abs(matched["mean_output_len"] - constrained["mean_output_len"]) <= 2, (matched, constrained)
        assert matched["constrained_over_matched_free"] > 0
    # the server's own timings of the workload's requests (histogram means; the populations
    # differ a little: requests cut at the window's end): waiting and prefill are a part of a request
    means = by["free 48/64 c=4"]["server_mean_s"]
    assert all(v is not None and 0 < v < 60 for v in means.values()), means
    assert means["engine_queue"] + means["engine_prefill"] < means["request"], means
    assert by["free 48/64 c=4"]["ttft_mean_s"] > 0 and by["free 48/64 c=4"]["client_cpu_max"] > 0
    assert shape["model_info"]["prefill_chunk_tokens"] == 512 and shape["workloads"][1]["engine"]["num_steps"] > 0
    # prefix caching: requests of the other workloads share no prefix; the shared system prompt
    # and the resent conversations are found cached, by the cache-on server only
    assert all(w["cached_prompt_fraction"] == 0 for w in shape["workloads"] if "cache on" not in w["name"])
    # (its first wave of 4 finds nothing yet; every request after it has the 256-token prefix cached,
    # 256 of its 272 prompt tokens: the bar follows how many the window finished on this machine)
    shared = by["shared-prefix 256+16/64 c=4 (cache on)"]
    assert shared["num_finished"] > 4
    assert shared["cached_prompt_fraction"] > 0.9 * (256 / 272) * (shared["num_finished"] - 4) / shared["num_finished"]
    multi_turn = by["multi-turn 64+3x(64+16) c=4 (cache on)"]
    assert multi_turn["cached_prompt_fraction"] > 0.2 and multi_turn["ttft_p50_later_turns_s"] is not None
    assert by["unshared 48/16 c=4 (cache on)"]["cached_prompt_fraction"] == 0
    assert set(shape["prefix_cache"]) == {"shared_prefix", "multi_turn", "unshared"}
    assert all(ratio["output_tok_s_on_over_off"] > 0 for ratio in shape["prefix_cache"].values())


def test_constrained_plan_runs_every_kind_beside_free_matched_on_cpu(tmp_path):
    """`--plan constrained` (its smoke): the closed loop, per-request schemas cold then warm,
    tools and reasoning + schema, each beside free requests of its output lengths."""
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps([json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                              "required": [f"k{i}"], "additionalProperties": False})
                                  for i in range(4)]))
    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, "benchmarks/serve.py", "--device", "cpu", "--shapes", "tiny-random", "--plan",
                    "constrained-smoke", "--corpus-schemas", str(corpus), "--duration", "2", "--warmup", "1",
                    "--client-procs", "2", "--out", str(out)], cwd=ROOT, check=True, timeout=600, capture_output=True)
    shape = json.loads(out.read_text())["shapes"][0]
    by = {w["name"]: w for w in shape["workloads"]}
    kinds = ["corpus-warm", "tools-auto", "tools-required", "reasoning-8+schema"]
    assert set(by) == {"free 48/160 c=4", "constrained 48/160 c=4", "free-matched 48/160 c=4", "corpus-cold 48/160 c=4"} | {
        name for kind in kinds for name in (f"{kind} 48/160 c=4", f"free-matched ({kind} 48/160 c=4)")}
    for w in shape["workloads"]:
        assert w["errors"] == {} and w["output_tokens_per_s"] > 0, w
    assert by["corpus-cold 48/160 c=4"]["compile_ms"], "the cold requests' compile times"
    steps = by["constrained 48/160 c=4"]["grammar_steps"]  # grammar_service's own, from its /metrics
    assert steps["steps"] > 0 and 0 < steps["fill_us"] <= steps["step_us"], steps
    group = shape["constrained"]
    assert set(group) == {"corpus", "tools-auto", "tools-required", "reasoning-8+schema"}
    assert all(kind["constrained_over_matched_free"] > 0 for kind in group.values())
    assert group["corpus"]["num_schemas"] == 4 and group["corpus"]["warm_over_single_schema"] > 0


def test_fp8_arm_runs_the_plan_again_beside_the_base_on_cpu(tmp_path):
    """`--quantization fp8 --kv-cache-dtype fp8` (plan fp8-smoke): the plan's workloads on the base
    server, then on one with those flags (the CPU runs FP8 layers by their fp32 reference), each
    FP8 workload named by its arm and read over its base twin. Both servers' KV caches get the same
    bytes, 3/4 of the loop's tokens in float32: the base preempts, e4m3 pages hold 4x the tokens
    and never do."""
    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, "benchmarks/serve.py", "--device", "cpu", "--shapes", "tiny-random", "--plan",
                    "fp8-smoke", "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--duration", "2", "--warmup", "1",
                    "--client-procs", "2", "--out", str(out)], cwd=ROOT, check=True, timeout=300, capture_output=True)
    shape = json.loads(out.read_text())["shapes"][0]
    base = ["free 48/64 c=4", "constrained 48/64 c=4", "free-matched 48/64 c=4"]
    assert [w["name"] for w in shape["workloads"]] == base + [f"{name} (fp8+fp8-kv)" for name in base]
    for w in shape["workloads"]:
        assert w["errors"] == {} and w["output_tokens_per_s"] > 0, w
    constrained = [w for w in shape["workloads"] if w["constrained"]]
    assert all(w["validation"] == {"VALIDATION_STATUS_VALID": w["num_finished"]} for w in constrained), constrained
    base_arm, fp8_arm = shape["arms"]
    assert (base_arm["arm"], fp8_arm["arm"]) == ("float32", "fp8+fp8-kv")
    assert fp8_arm["server_flags"][:4] == ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    assert "--quantization" not in base_arm["server_flags"] and "--kv-cache-dtype" not in base_arm["server_flags"]
    assert fp8_arm["num_kv_pages_total"] == 4 * base_arm["num_kv_pages_total"]  # the same bytes: e4m3 over float32
    over = shape["over_base"]
    assert set(over) == {f"{name} (fp8+fp8-kv)" for name in base}
    for name, ratios in over.items():
        assert ratios["base"] == name.removesuffix(" (fp8+fp8-kv)")
        assert all(ratios[k] > 0 for k in ("output_tok_s", "ttft_p50", "itl_p50")), ratios
        assert ratios["num_preemptions"]["float32"] > 0 and ratios["num_preemptions"]["fp8+fp8-kv"] == 0, ratios
    matched = over["free-matched 48/64 c=4 (fp8+fp8-kv)"]["constrained_over_matched_free"]
    assert set(matched) == {"float32", "fp8+fp8-kv"} and all(v > 0 for v in matched.values())
