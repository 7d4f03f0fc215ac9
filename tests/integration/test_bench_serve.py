"""benchmarks/serve.py's harness on CPU (the GPU run is the benchmark): the real `structgen serve`
with the built-in tiny-random model, client processes over gRPC, every workload of the smoke plan measured,
no call failed, and the free-matched run replays the constrained run's output lengths."""
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
                    "--duration", "1.5", "--warmup", "0.5", "--client-procs", "2", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=600, capture_output=True)
    shape = json.loads(out.read_text())["shapes"][0]
    names = [w["name"] for w in shape["workloads"]]
    assert names == ["idle-ttft-64"] + [f"{kind} 48/16 c={c}" for c in (1, 4)
                                        for kind in ("free", "constrained", "free-matched")] + [names[-1]]
    assert names[-1].startswith("poisson 48/16 0.50x")
    for w in shape["workloads"]:
        assert w["errors"] == {} and w["num_finished"] > 0, w
        assert w["num_requests"] == 3 or w["output_tokens_per_s"] > 0, w
    by = {w["name"]: w for w in shape["workloads"]}
    for c in (1, 4):
        constrained, matched = by[f"constrained 48/16 c={c}"], by[f"free-matched 48/16 c={c}"]
        assert sum(constrained["validation"].values()) == constrained["num_finished"]  # every output checked
        assert abs(matched["mean_output_len"] - constrained["mean_output_len"]) <= 2, (matched, constrained)
        assert matched["constrained_over_matched_free"] > 0
    assert shape["model_info"]["prefill_chunk_tokens"] == 512 and shape["workloads"][1]["engine"]["num_steps"] > 0
