"""The grammar sidecar as the Helm chart runs it (issue 7): `structgen grammar` with
--metrics-port and --health-port, probed by `structgen grammar-health`; its compile and
mask-fill metrics move; SIGTERM exits 0 at once and removes the socket."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from channel_driver import ChannelDriver, Row
from grammar_contract.client import GrammarControlClient
from grammar_contract.spec import GrammarSpec
from ports import free_port
from real_tokenizers import continuation_ids
from step_channel import Geometry, StepChannel
from structgen.supervisor import wait_healthy
from structgen.tokenizer_identity import fingerprint_tokenizer_json

VOCAB = 32768
GEOMETRY = Geometry(max_batch=2, max_positions=1, vocab_size=VOCAB)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _sum(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix + "["))


def _grammar_health(address: str) -> int:
    return subprocess.run([sys.executable, "-m", "structgen.cli", "grammar-health", f"--address={address}",
                           "--timeout-s=2"], cwd=ROOT, timeout=60).returncode


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory, mistral_32k_dir):
    sock = tmp_path_factory.mktemp("sidecar") / "grammar.sock"
    metrics_port, health_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "structgen.cli", "grammar", "--listen", f"unix://{sock}",
                             f"--metrics-port={metrics_port}", f"--health-port={health_port}",
                             "--tokenizer-dir", mistral_32k_dir, "--vocab-size", str(VOCAB)], cwd=ROOT)
    assert wait_healthy(f"unix://{sock}", 120, proc), f"grammar_service not healthy (exit code {proc.poll()})"
    client = GrammarControlClient(f"unix://{sock}")
    yield proc, client, sock, metrics_port, health_port
    client.close()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_probes_exec_and_grpc(sidecar):
    _, _, sock, _, health_port = sidecar
    assert _grammar_health(f"unix://{sock}") == 0
    assert _grammar_health(f"unix://{sock}.missing") == 1
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_compile_and_mask_fill_metrics_move(sidecar, mistral_32k_dir, mistral_32k):
    _, client, _, metrics_port, _ = sidecar
    before = _scrape(metrics_port)
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    with StepChannel.create(GEOMETRY) as chan:
        client.open_channel(chan.name, GEOMETRY, max_slots=2, first_step=1, tokenizer_dir=mistral_32k_dir,
                            tokenizer_fingerprint=fingerprint_tokenizer_json(mistral_32k_dir, VOCAB))
        compiled = client.compile(GrammarSpec("json_schema", schema)).result(60)
        assert client.compile(GrammarSpec("json_schema", schema)).result(60).cache_hit
        ids = continuation_ids(mistral_32k, '{"ok": true}')[:3]
        driver = ChannelDriver(chan)
        rows = [Row.fresh(0, compiled.grammar_id)]
        for token in ids:
            driver.step(rows)
            driver.finish([[token]])
            rows = [Row(0)]  # the same constrained slot, one position
        driver.step([Row.release_only(0)])
        client.close_channel(chan.name)
    after = _scrape(metrics_port)

    def moved(prefix: str) -> float:
        return _sum(after, prefix) - _sum(before, prefix)

    assert moved("structgen_grammar_compile_seconds_count") == 1
    hits = lambda samples: sum(v for k, v in samples.items()  # noqa: E731
                               if k.startswith("structgen_grammar_compile_requests_total[") and "'cache_hit'" in k)
    assert hits(after) - hits(before) == 1
    assert moved("structgen_grammar_step_seconds_count") == len(ids) + 1
    assert moved("structgen_grammar_step_seconds_sum") > 0


def test_sigterm_exits_0_promptly_and_removes_the_socket(sidecar):
    proc, _, sock, _, _ = sidecar
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert time.monotonic() - started < 5, "shutdown took most of a drain budget"
    assert not os.path.exists(sock)
