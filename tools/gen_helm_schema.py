#!/usr/bin/env python3
"""Writes helm/structgen/values.schema.json (the strict schema of the chart's values) and the
`config:` block of values.yaml (the process settings) from the settings tables.

Edit the schema here and the settings in generation_service/settings.py and
grammar_service/settings.py, not the outputs: `.venv/bin/python tools/gen_helm_schema.py`
rewrites both, and tests/unit/ops/test_helm.py fails when they disagree. Every object of the
chart's own values is closed (additionalProperties: false), so a misspelt key fails `helm
install`. Kubernetes objects passed through (resources, affinity, ...) are only type-checked
here; kubernetes-validate checks them after rendering (tools/check_helm.sh).
"""
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from generation_service.settings import SERVE_SETTINGS  # noqa: E402
from grammar_service.settings import GRAMMAR_SETTINGS  # noqa: E402
from structgen.settings import format_value, to_json_schema  # noqa: E402

OUT = ROOT / "helm" / "structgen" / "values.schema.json"
VALUES = ROOT / "helm" / "structgen" / "values.yaml"
# config.<group> -> the table whose chart settings it holds
CHART_GROUPS = {"engine": SERVE_SETTINGS, "server": SERVE_SETTINGS, "grammar": GRAMMAR_SETTINGS}
BEGIN = "# BEGIN settings: written by tools/gen_helm_schema.py from generation_service/settings.py"
END = "# END settings"

def obj(props, required=None, **kw):
    """A closed object; every property required unless `required` says otherwise."""
    d = {"type": "object", "additionalProperties": False, "properties": props}
    d["required"] = sorted(required if required is not None else props)
    d.update(kw)
    return d

def s(desc=None, **kw):
    d = {"type": "string", **kw}
    if desc: d["description"] = desc
    return d

def i(minimum=None, maximum=None, desc=None):
    d = {"type": "integer"}
    if minimum is not None: d["minimum"] = minimum
    if maximum is not None: d["maximum"] = maximum
    if desc: d["description"] = desc
    return d

b = {"type": "boolean"}
port = i(1, 65535)
k8s_obj = {"type": "object", "description": "Kubernetes object, passed through; validated after rendering."}
k8s_list = {"type": "array", "items": {"type": "object"}}
str_map = {"type": "object", "additionalProperties": {"type": "string"}}
quantity = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$"}
duration = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h))+$"}
env_name = r"^[A-Za-z_][A-Za-z0-9_]*$"
image_repo = s(pattern=r"^[a-z0-9]+([._/:-][a-z0-9]+)*$", minLength=1)
image_tag = s(pattern=r"^([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$")
env_list = {"type": "array", "items": {"type": "object", "required": ["name"],
            "properties": {"name": s(pattern=env_name)}}}
args = {"type": "array", "items": {"type": "string"}}
probe_timing = obj({"periodSeconds": i(1), "timeoutSeconds": i(1), "failureThreshold": i(1)})
int_or_percent = {"oneOf": [i(0), s(pattern=r"^[0-9]+%$")]}
name253 = s(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", maxLength=253)


def opt(t):
    """null or t. Helm drops null keys, so an optional value must accept null in values.yaml."""
    return {"anyOf": [{"type": "null"}, t]}


schema = obj({
    "replicaCount": i(0),
    "image": obj({"repository": image_repo, "tag": image_tag,
                  "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}),
    "imagePullSecrets": {"type": "array", "items": obj({"name": name253})},
    "nameOverride": s(maxLength=63),
    "fullnameOverride": s(maxLength=63),
    "gpu": obj({"enabled": b, "count": i(1), "resourceName": s(pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$")}),
    "tensorParallel": i(1, desc="--tensor-parallel: GPUs (processes) the model is sharded over; the pod "
                        "requests max(gpu.count, tensorParallel) GPUs."),
    "runtimeClassName": s(),
    "model": obj({
        "name": s("Checkpoint directory or built-in model name; empty = built-in default."),
        "mountPath": s(pattern=r"^/"),
        "volume": obj({
            "type": {"enum": ["none", "hostPath", "pvc", "emptyDir"]},
            "hostPath": obj({"path": s(), "type": {"enum": ["", "Directory", "DirectoryOrCreate"]}}),
            "pvc": obj({"claimName": s()}),
            "emptyDir": obj({"sizeLimit": quantity}),
        }, allOf=[
            {"if": {"properties": {"type": {"const": "hostPath"}}},
             "then": {"properties": {"hostPath": {"properties": {"path": s(pattern=r"^/")}}}}},
            {"if": {"properties": {"type": {"const": "pvc"}}},
             "then": {"properties": {"pvc": {"properties": {"claimName": name253}}}}},
        ]),
    }),
    "config": obj({
        "logLevel": {"enum": ["debug", "info", "warning", "error", "DEBUG", "INFO", "WARNING", "ERROR"]},
        **{group: obj({b.setting.chart_key: to_json_schema(b) for b in table.chart_settings(group)},
                      required=[])
           for group, table in CHART_GROUPS.items()},
        "extraEnv": {"type": "object", "propertyNames": {"pattern": env_name},
                     "additionalProperties": {"type": "string"}},
    }, required=["logLevel", *CHART_GROUPS, "extraEnv"]),
    "otel": obj({
        "enabled": b,
        "endpoint": s(pattern=r"^(https?://[^\s]+)?$"),
        "protocol": {"enum": ["grpc"]},
        "insecure": b,
        "serviceName": s(minLength=1, pattern=r"^[A-Za-z0-9_.-]+$"),
        "sampler": {"enum": ["always_on", "always_off", "traceidratio", "parentbased_always_on",
                             "parentbased_always_off", "parentbased_traceidratio"]},
        "samplerArg": s(pattern=r"^(0(\.[0-9]+)?|1(\.0+)?)$"),
        "resourceAttributes": {"type": "object", "propertyNames": {"pattern": r"^[A-Za-z0-9_.]+$"},
                               "additionalProperties": s(pattern=r"^[^,=]*$")},
    }, allOf=[{"if": {"properties": {"enabled": {"const": True}}},
               "then": {"properties": {"endpoint": s(minLength=1)}}}]),
    "ports": obj({"grpc": port, "metrics": port, "health": port}),
    "httpApi": obj({"enabled": b, "port": port}),
    "service": obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                    "annotations": str_map, "headless": obj({"enabled": b})}),
    "terminationGracePeriodSeconds": i(1),
    "generation": obj({
        "drainSeconds": i(0), "preStopDelaySeconds": i(0),
        "resources": k8s_obj, "extraArgs": args, "extraEnv": env_list,
        "startupProbe": probe_timing, "livenessProbe": probe_timing, "readinessProbe": probe_timing,
    }),
    "grammar": obj({
        "image": obj({"repository": {"anyOf": [{"const": ""}, image_repo]}, "tag": image_tag}),
        "drainDelaySeconds": i(0),
        "healthProbe": obj({"type": {"enum": ["exec", "grpc"]}, "port": port,
                            "periodSeconds": i(1), "timeoutSeconds": i(1), "failureThreshold": i(1)}),
        "metrics": obj({"enabled": b, "port": port}),
        "resources": k8s_obj, "extraArgs": args, "extraEnv": env_list,
    }, required=["image", "drainDelaySeconds", "healthProbe", "metrics", "resources", "extraArgs", "extraEnv"]),
    "sharedMemory": obj({"sizeLimit": quantity}),
    "scratch": obj({"sizeLimit": quantity}),
    "tls": obj({
        "enabled": b, "secretName": s(),
        "clientCA": obj({"enabled": b, "secretName": s(), "key": s(minLength=1, pattern=r"^[-._A-Za-z0-9]+$")}),
    }, allOf=[
        {"if": {"properties": {"enabled": {"const": True}}},
         "then": {"properties": {"secretName": name253}}},
        {"if": {"properties": {"clientCA": {"properties": {"enabled": {"const": True}}}}},
         "then": {"properties": {"enabled": {"const": True}}}},
    ]),
    "auth": obj({"enabled": b, "secretName": s(),
                 "key": s(minLength=1, pattern=r"^[-._A-Za-z0-9]+$")},
                allOf=[{"if": {"properties": {"enabled": {"const": True}}},
                        "then": {"properties": {"secretName": name253}}}]),
    "autoscaling": obj({
        "enabled": b, "minReplicas": i(1), "maxReplicas": i(1),
        "targetCPUUtilizationPercentage": opt(i(1, 100)),
        "metrics": k8s_list, "behavior": k8s_obj,
    }, required=["enabled", "minReplicas", "maxReplicas", "metrics", "behavior"]),
    "podDisruptionBudget": obj({"enabled": b, "maxUnavailable": opt(int_or_percent),
                                "minAvailable": opt(int_or_percent)},
                               required=["enabled"],
                               description="minAvailable, when set, replaces maxUnavailable."),
    "serviceMonitor": obj({"enabled": b, "namespace": s(), "labels": str_map,
                           "interval": duration, "scrapeTimeout": duration}),
    "serviceAccount": obj({"create": b, "name": s(), "annotations": str_map}),
    "podAnnotations": str_map,
    "podLabels": str_map,
    "podSecurityContext": k8s_obj | {"properties": {
        "runAsNonRoot": {"const": True},
        "runAsUser": i(1, desc="Non-root: the step channel and socket are owner-only files."),
    }, "required": ["runAsNonRoot", "runAsUser"]},
    "securityContext": k8s_obj | {"properties": {
        "runAsNonRoot": {"const": True},
        "runAsUser": i(1, desc="Non-root, as in podSecurityContext."),
    }},
    "networkPolicy": obj({
        "enabled": b,
        "apiFrom": {"type": "array", "items": {"type": "object"},
                    "description": "NetworkPolicyPeers allowed to call the gRPC port; empty = any."},
        "metricsFrom": {"type": "array", "items": {"type": "object"},
                        "description": "NetworkPolicyPeers allowed to scrape /metrics; empty = any."},
    }),
    "tests": obj({"enabled": b, "prompt": s(minLength=1), "maxTokens": i(1)}),
    "strategy": k8s_obj,
    "priorityClassName": s(),
    "nodeSelector": str_map,
    "tolerations": k8s_list,
    "affinity": k8s_obj,
    "topologySpreadConstraints": k8s_list,
    "initContainers": k8s_list,
}, title="structgen chart values")
schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def render() -> str:
    return json.dumps(schema, indent=2) + "\n"


def _yaml_scalar(value) -> str:
    return "null" if value is None else format_value(value)


def render_config_block() -> str:
    """The values.yaml block of the settings: one commented key per chart setting."""
    lines = [BEGIN,
             "# Settings of both processes -> the ConfigMap's STRUCTGEN_* variables, which both",
             "# containers read (envFrom). null = the process default: `structgen serve --help`,",
             "# `structgen grammar --help`, docs/operations.md. Edit the settings tables, then rerun it.",
             "config:",
             "  # STRUCTGEN_LOG_LEVEL, both containers",
             "  logLevel: info"]
    headers = {"engine": "EngineConfig (--max-batch, ...) -> STRUCTGEN_<FLAG>",
               "server": "ServeConfig, the gRPC edge -> STRUCTGEN_<FLAG>",
               "grammar": "grammar_service (`structgen grammar`) -> STRUCTGEN_GRAMMAR_<FLAG>"}
    for group, table in CHART_GROUPS.items():
        lines += [f"  # {headers[group]}", f"  {group}:"]
        for b in table.chart_settings(group):
            lines += [f"    # {line}" for line in textwrap.wrap(b.setting.help, 88)]
            lines.append(f"    {b.setting.chart_key}: {_yaml_scalar(b.setting.chart_default)}")
    lines += ["  # Extra variables added verbatim to the ConfigMap (string values).", "  extraEnv: {}", END]
    return "\n".join(lines) + "\n"


def values_with_config_block(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END) + 1
    return text[:start] + render_config_block() + text[end:]


if __name__ == "__main__":
    OUT.write_text(render())
    VALUES.write_text(values_with_config_block(VALUES.read_text()))
    print(f"wrote {OUT} and the settings block of {VALUES}")
