"""The chart as a pod would run it: `helm template` renders the two containers, both processes
start here with exactly the rendered arguments and environment (only addresses and ports
rewritten to this machine), and the settings they log at start are the values given; then
the `helm test` pod's two commands run against that server."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from live_server import start_serve, stop_serve
from ports import free_port
from structgen.supervisor import wait_healthy

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "structgen"
SOCKET = "unix:///run/structgen/grammar.sock"
VALUES = {
    "gpu": {"enabled": False},
    "generation": {"drainSeconds": 20, "preStopDelaySeconds": 1},
    "config": {
        "logLevel": "info",
        "engine": {"maxBatch": 3, "maxWaiting": 17, "maxNewTokensLimit": 96, "maxPromptTokens": 700,
                   "maxDraftTokens": 2, "grammarWaitTimeoutS": 7.5, "runner": "eager", "dtype": "float32"},
        "server": {"maxConcurrentRpcs": 1024, "numWorkers": 24, "maxGrammarBytes": 65536,
                   "defaultMaxTokens": 12, "keepaliveTimeS": 30, "maxConnectionAgeGraceS": 600},
        "grammar": {"numCompileThreads": 1, "numFillThreads": 1, "numLlguidanceLanes": 1,
                    "maxCachedGrammars": 99},
    },
}
# The container's environment that is about the pod's filesystem, not settings.
POD_PATHS = {"HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"}



@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    helm = subprocess.run([str(ROOT / "tools" / "install_helm.sh")], capture_output=True, text=True)
    assert helm.returncode == 0, helm.stderr
    values = tmp_path_factory.mktemp("chart") / "values.yaml"
    values.write_text(yaml.safe_dump(VALUES))
    out = subprocess.run([helm.stdout.strip().splitlines()[-1], "template", "sg", str(CHART), "-f", str(values)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}


def _container(rendered: dict, name: str) -> dict:
    pod = rendered[("Deployment", "sg-structgen")]["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


def _environment(rendered: dict, container: dict) -> dict[str, str]:
    """This machine's environment without STRUCTGEN_*, plus the ConfigMap and the container's env."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("STRUCTGEN_", "OTEL_"))}
    environ.update(rendered[("ConfigMap", "sg-structgen")]["data"])
    environ.update({e["name"]: e["value"] for e in container.get("env", [])
                    if "value" in e and e["name"] not in POD_PATHS})
    return environ


def _logged_settings(log_text: str) -> dict:
    match = re.search(r"settings: (\{.*\})", log_text)
    assert match, log_text[-3000:]
    return json.loads(match.group(1))


@pytest.fixture(scope="module")
def pod(rendered, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pod")
    socket_address = f"unix://{folder}/grammar.sock"
    grammar = _container(rendered, "grammar")
    grammar_args = [a.replace(SOCKET, socket_address) for a in grammar["args"]]
    grammar_log = folder / "grammar.log"
    sidecar = subprocess.Popen([sys.executable, "-m", "structgen.cli", *grammar_args], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=open(grammar_log, "w"),
                               env={**_environment(rendered, grammar), "PYTHONUNBUFFERED": "1"})
    assert wait_healthy(socket_address, 120, sidecar), grammar_log.read_text()[-3000:]

    generation = _container(rendered, "generation")
    metrics_port = free_port()
    rewrites = {"--host=0.0.0.0": "--host=127.0.0.1", "--port=50051": "--port=0",
                "--metrics-port=9400": f"--metrics-port={metrics_port}"}
    args = [rewrites.get(a, a.replace(SOCKET, socket_address)) for a in generation["args"][1:]]
    with pytest.MonkeyPatch.context() as patch:
        for name in [k for k in os.environ if k.startswith(("STRUCTGEN_", "OTEL_"))]:
            patch.delenv(name)
        for name, value in _environment(rendered, generation).items():
            patch.setenv(name, value)
        server = start_serve(args, folder / "serve.log")
    server.grammar_log = grammar_log
    yield server
    assert stop_serve(server) == 0
    sidecar.terminate()
    assert sidecar.wait(30) == 0


def test_serve_runs_with_the_values_given(pod, rendered):
    settings = _logged_settings(pod.log_text())
    engine, serve = settings["EngineConfig"], settings["ServeConfig"]
    values = VALUES["config"]
    assert (engine["max_batch"], engine["max_waiting"], engine["max_new_tokens_limit"], engine["max_prompt_tokens"],
            engine["max_draft_tokens"], engine["grammar_wait_timeout_s"], engine["runner"], engine["dtype"]) == (
        3, 17, 96, 700, 2, 7.5, "eager", "float32")
    assert (serve["max_concurrent_rpcs"], serve["num_workers"], serve["max_grammar_bytes"],
            serve["default_max_tokens"], serve["keepalive_time_s"], serve["max_connection_age_grace_s"]) == (
        1024, 24, 65536, 12, 30, 600)
    assert serve["max_connection_age_s"] == 300  # the chart's own default
    assert serve["grace_s"] == VALUES["generation"]["drainSeconds"] and engine["device"] == "cpu"
    assert settings["ProcessConfig"]["log_level"] == values["logLevel"].upper()
    for line in pod.log_text().splitlines():
        assert "deprecated" not in line and "no structgen setting reads it" not in line, line


def test_grammar_sidecar_runs_with_the_values_given(pod):
    grammar = _logged_settings(pod.grammar_log.read_text())["GrammarServiceConfig"]
    assert (grammar["num_compile_threads"], grammar["num_fill_threads"], grammar["num_llguidance_lanes"],
            grammar["max_cached_grammars"]) == (1, 1, 1, 99)
    assert grammar["max_grammar_bytes"] == 65536  # config.server.maxGrammarBytes reaches both


def test_the_server_reports_the_limits_it_was_given(pod):
    from structgen_client import Client
    with Client(pod.address, timeout=60) as client:
        info = client.model_info()
    assert (info.max_batch, info.max_new_tokens_limit, info.max_prompt_tokens, info.max_grammar_bytes,
            info.default_max_tokens, info.max_draft_tokens) == (3, 96, 700, 65536, 12, 2)


def test_helm_test_pod_commands_pass_against_the_server(pod, rendered):
    test_pod = rendered[("Pod", "sg-structgen-test")]["spec"]
    service = "sg-structgen:50051"
    for container in (*test_pod["initContainers"], *test_pod["containers"]):
        args = [a.replace(service, pod.address) for a in container["args"]]
        result = subprocess.run([sys.executable, "-m", "structgen.cli", *args], cwd=ROOT, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, f"{container['name']}: {result.stdout}{result.stderr}"
        if container["name"] == "generate":
            assert result.stdout.strip() and "finish" in result.stderr  # --verbose reports the end
