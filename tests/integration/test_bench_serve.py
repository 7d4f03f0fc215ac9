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
    assert by["shared-prefix 256+16/64 c=4 (cache on)"]["cached_prompt_fraction"] > 0.8
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
    group = shape["constrained"]
    assert set(group) == {"corpus", "tools-auto", "tools-required", "reasoning-8+schema"}
    assert all(kind["constrained_over_matched_free"] > 0 for kind in group.values())
    assert group["corpus"]["num_schemas"] == 4 and group["corpus"]["warm_over_single_schema"] > 0
