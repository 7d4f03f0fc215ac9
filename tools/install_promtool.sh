#!/usr/bin/env bash
# Puts promtool (`promtool check metrics`, the Prometheus project's linter of exposition text)
# into .tools/bin/promtool, idempotently.
#
# It comes from Debian's `prometheus` package: `apt-get download` fetches the .deb (apt checks
# it against the signed archive index) and `dpkg-deb -x` extracts only usr/bin/promtool, a
# static binary, so nothing is installed and no service starts. On a machine whose apt lists
# are empty it runs `apt-get update` first (as root, like CI).
#
# Usage: tools/install_promtool.sh   (prints the path of promtool)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="$ROOT/.tools/bin"
PROMTOOL="$BIN_DIR/promtool"

if [[ -x "$PROMTOOL" ]] && "$PROMTOOL" --version >/dev/null 2>&1; then
  echo "$PROMTOOL"
  exit 0
fi
for tool in apt-get dpkg-deb; do
  command -v "$tool" >/dev/null || { echo "install_promtool.sh: needs $tool (Debian/Ubuntu); or put promtool in $PROMTOOL" >&2; exit 1; }
done

mkdir -p "$BIN_DIR"
WORK="$(mktemp -d "$ROOT/.tools/promtool-download.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
if ! apt-get download prometheus >/dev/null 2>&1; then
  echo "install_promtool.sh: apt-get update, then downloading Debian's prometheus package" >&2
  apt-get update -qq >&2
  apt-get download prometheus >&2
fi
dpkg-deb -x prometheus_*.deb extracted
install -m 0755 extracted/usr/bin/promtool "$PROMTOOL.partial"
mv -f "$PROMTOOL.partial" "$PROMTOOL"   # atomic for a concurrent caller
"$PROMTOOL" --version >/dev/null
echo "$PROMTOOL"
