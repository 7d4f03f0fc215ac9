#!/usr/bin/env bash
# Builds the Go example client into .tools/bin/structgen-go from Debian's Go packages only
# (GOPATH mode, no module downloads):
#   apt-get install golang-go golang-google-grpc-dev golang-google-protobuf-dev \
#     golang-github-golang-protobuf-1-5-dev protoc-gen-go protoc-gen-go-grpc
# Stubs are generated from protos/ into gopath/src/structgen/structgenv1/ (gitignored).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="$ROOT/gopath/src/structgen/structgenv1"
mkdir -p "$OUT" "$ROOT/.tools/bin"
# grpc_tools' protoc (from the venv) with Debian's Go plugins; M maps the file to the Go package.
"$PY" -m grpc_tools.protoc -I"$ROOT/protos" \
  --plugin=protoc-gen-go=/usr/bin/protoc-gen-go --plugin=protoc-gen-go-grpc=/usr/bin/protoc-gen-go-grpc \
  --go_out="$OUT" --go_opt=paths=source_relative,Mstructgen/v1/generation.proto=structgen/structgenv1 \
  --go-grpc_out="$OUT" --go-grpc_opt=paths=source_relative,Mstructgen/v1/generation.proto=structgen/structgenv1 \
  structgen/v1/generation.proto
mv "$OUT"/structgen/v1/*.go "$OUT"/ && rm -rf "$OUT/structgen"
cd "$ROOT"
GO111MODULE=off GOPATH="$ROOT/gopath:/usr/share/gocode" GOCACHE="$ROOT/.cache/go-build" \
  go build -o "$ROOT/.tools/bin/structgen-go" clients/go/main.go
echo "$ROOT/.tools/bin/structgen-go"
