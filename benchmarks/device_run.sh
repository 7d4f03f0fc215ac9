#!/usr/bin/env bash
# The one script a device call runs: GPU tests, the serving benchmark (benchmarks/serve.py), the
# decode benchmark, the verify-graphs benchmark, and the grammar-step benchmark on the host's CPUs.
# Carry (all ignored paths): structgen/v1 (generated protos: `make protos`), .whl and .bench.
# .whl (../shared/device/wheels.sh .whl NAME==VERSION ...): xgrammar 0.2.9 + apache-tvm-ffi, pydantic,
#   pydantic-core, annotated-types, typing-inspection, typing-extensions, attrs; for grammar_service over
#   gRPC grpcio 1.85.3, grpcio-health-checking/-reflection 1.85.1, protobuf 7.36.2, jsonschema 4.26.0
#   (+ -specifications, referencing, rpds-py), opentelemetry-api/-sdk 1.45.2 + semantic-conventions
#   0.66b2 (the device image lacks these), and llguidance 1.9.1 (abi3, manylinux_2_31):
#   grammar_service's auto backend then picks it, as in the GPU image; for the HTTP front
#   (serve.py --plan http) fastapi 0.165.0, starlette 1.10.0, uvicorn 0.54.0, httptools 0.9.0; gguf 0.19.0;
#   py-spy 0.4.3 for SERVE_PROFILE.
#   (The built-in default model's 94 MiB GGUF does not fit the 64 MiB transfer: tests/gpu/test_default_model_gpu.py
#   cannot run there.)
# .bench: the real tokenizers as tgz, made here from the converted copies:
#   tar czf .bench/<name>.tgz -C ~/.cache/structgen/tokenizers <name>   (tekken_131k, mistral_32k)
#   run: bash benchmarks/device_run.sh [tests|serve|serve-ab|slow|bench|verify|profile|gemv|grammar|ab|all|a,b,...] [extra decode.py args...]
#   (TESTS: the test paths, default tests/gpu; SERVE_ARGS: serve.py's arguments, default the full plan;
#    SERVE_NAME: its result's name under $OUT, default serve-$GPU; SLOW_SHAPES / SLOW_ARGS: slow_row.py's
#    shapes and arguments; SERVE_PROFILE: py-spy the server
#    through the workloads whose name holds it, e.g. "free 512/128 c=128" (py-spy in .whl); SERVE_ARGS may add
#    --profile-mode wall)
#   (PROFILE_ARGS: extra profile_step.py args, e.g. "--variants gemv+pdl-torch-prologue gemv+pdl";
#    GRAMMAR_ARGS: grammar_step.py's workload args instead of the default)
# Set STRUCTGEN_CODE_COMMIT=<this checkout's HEAD> in the call: the device's copy of git may be at the
#   session's first commit, not the one measured (the result files' code_commit).
# Writes under $OUT ($GPU: h200 or h100, the card the call got): env.txt, tests.log, junit.xml, serve.log,
#   serve-$GPU.json, bench.log, decode-$GPU.json, grammar_step.log, grammar_step-$GPU-host-<N>cpu.json,
#   profile.log, profile-$GPU.json, kernels-gemv.log, kernels-gemv-$GPU.json, verify.log, verify-$GPU.json,
#   decode-ab-<name>.json|.log, slow_row-$GPU-<shape>.json|.log.
set -uo pipefail
what=${1:-all}; shift || true   # one part, a comma-separated list, or all
want() { [[ $what == all || ,$what, == *,$1,* ]]; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# result files are named by the card this call got (the device tool lends an H100 or an H200)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -qi h200 && echo h200 || echo h100)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} || { echo "wheel install failed"; exit 1; }
# the real tokenizers where tests/real_tokenizers.py looks for them (no conversion on the device)
mkdir -p ~/.cache/structgen/tokenizers && for t in .bench/*.tgz; do tar xzf "$t" -C ~/.cache/structgen/tokenizers; done
export STRUCTGEN_TEKKEN_DIR=$HOME/.cache/structgen/tokenizers/tekken_131k
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  nproc
  python3 - <<'PY'
import torch, triton, xgrammar, grpc, google.protobuf
from cuda.bindings import driver as cu
cu.cuInit(0)
dev = cu.cuDeviceGet(0)[1]
A = cu.CUdevice_attribute
for name in ("CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR", "CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM",
             "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES", "CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED"):
    if hasattr(A, name):
        print(name, cu.cuDeviceGetAttribute(getattr(A, name), dev)[1])
print("torch", torch.__version__, "triton", triton.__version__, "xgrammar", getattr(xgrammar, "__version__", "?"),
      "grpc", grpc.__version__, "protobuf", google.protobuf.__version__)
PY
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
rc=0
if want tests; then
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -p no:cacheprovider -m gpu ${TESTS:-tests/gpu} -v -s --timeout=120 \
    --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|round trip|graph ==|diverged|passed|failed|Error|error" | tail -40
  rc=$?
fi
if want serve; then
  timeout ${SERVE_TIMEOUT:-540} python3 benchmarks/serve.py --out "$OUT/${SERVE_NAME:-serve-$GPU}.json" \
    ${SERVE_PROFILE:+--profile "$SERVE_PROFILE"} ${SERVE_ARGS:-} 2>&1 \
    | tee "$OUT/${SERVE_NAME:-serve-$GPU}.log" | tail -70
fi
if want slow; then
  # issue 19 point 6: one slow grammar among 63 ordinary requests, per shape (random weights, Tekken)
  for shape in ${SLOW_SHAPES:-llama-3.2-1b llama-3.1-8b}; do
    folder=$(python3 -c "import sys; from benchmarks._harness import random_model_folder as f; import pathlib; \
print(f(sys.argv[1], sys.argv[2], pathlib.Path('/tmp/m-' + sys.argv[1]), 131072, 16384))" "$shape" "$STRUCTGEN_TEKKEN_DIR")
    timeout ${SLOW_TIMEOUT:-200} python3 benchmarks/slow_row.py --device cuda --model "random:$folder/config.json" \
      --label "$GPU-$shape" --out "$OUT/slow_row-$GPU-$shape.json" ${SLOW_ARGS:---slow-fill-ms 50 --slow-max-tokens 24 --max-tokens 64 --repeats 3} \
      2>&1 | tee "$OUT/slow_row-$GPU-$shape.log" | tail -15
  done
fi
if want bench; then
  timeout ${BENCH_TIMEOUT:-180} python3 benchmarks/decode.py --out "$OUT/decode-$GPU.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -45
fi
if want verify; then
  # speculative verify steps: captured verify graphs vs eager verify vs no speculation (Engine)
  timeout ${VERIFY_TIMEOUT:-180} python3 benchmarks/verify.py --out "$OUT/verify-$GPU.json" 2>&1 | tee "$OUT/verify.log" | tail -40
fi
if want profile; then
  # where the free decode step's time goes (cuBLAS GEMMs, then with the Triton GEMVs)
  timeout ${PROFILE_TIMEOUT:-150} python3 benchmarks/profile_step.py --out "$OUT/profile-$GPU.json" ${PROFILE_ARGS:-} 2>&1 \
    | tee "$OUT/profile.log" | tail -60
fi
if want gemv; then
  timeout ${GEMV_TIMEOUT:-150} python3 benchmarks/kernels.py --only gemv,gemv_decode --out "$OUT/kernels-gemv-$GPU.json" 2>&1 \
    | tee "$OUT/kernels-gemv.log" | tail -70
fi
if want grammar; then
  # both backends (.whl carries llguidance 1.9.1) on the 131k vocabulary, medians of 3 repeats
  # GRAMMAR_ARGS replaces the workload arguments (e.g. an A/B: "--num-schemas 1 --lanes 1 4 ...")
  timeout ${GRAMMAR_TIMEOUT:-150} python3 benchmarks/grammar_step.py --machine $GPU-host-$(nproc)cpu \
    ${GRAMMAR_ARGS:---backends llguidance xgrammar --vocabs tekken_131k --workloads random replay --batches 64 128 --repeats 3} \
    --out "$OUT/grammar_step-$GPU-host-$(nproc)cpu.json" 2>&1 | tee "$OUT/grammar_step.log" | tail -30
fi
if want serve-ab; then
  # serve.py on several versions of the code, interleaved round by round on this machine (runs of one
  # code differ by ~10 % between calls, docs/serving.md): SERVE_AB="name:.bench/code_name.tar.gz;..." (each
  # made beforehand with `git archive --format=tar.gz COMMIT -o .bench/code_NAME.tar.gz`, carried in .bench; not
  # .tgz: those are the tokenizers, unpacked above),
  # SERVE_AB_ROUNDS rounds (default 2), SERVE_ARGS as for serve (add --repeats K); writes
  # serve-ab-<name>-<round>.json|.log, code_commit read from each archive
  IFS=';' read -ra versions <<< "${SERVE_AB:-}"
  for round in $(seq 1 "${SERVE_AB_ROUNDS:-2}"); do
    for version in "${versions[@]}"; do
      name=${version%%:*}; archive=$PWD/${version#*:}; tree=/tmp/serve-ab-$name
      if [[ ! -d $tree ]]; then
        mkdir -p "$tree" && tar xzf "$archive" -C "$tree" && cp -r structgen/v1 "$tree/structgen/"
      fi
      commit=$(gzip -dc "$archive" | git get-tar-commit-id)
      (cd "$tree" && PYTHONPATH=/tmp/site:$tree STRUCTGEN_CODE_COMMIT=${commit:0:7} timeout ${SERVE_TIMEOUT:-540} \
        python3 benchmarks/serve.py --out "$OUT/serve-ab-$name-$round.json" ${SERVE_ARGS:-} \
        > "$OUT/serve-ab-$name-$round.log" 2>&1)
      echo "== $name (${commit:0:7}) round $round"; tail -5 "$OUT/serve-ab-$name-$round.log"
    done
  done
fi
if want ab; then
  # decode.py A/B, one process per run: AB_RUNS="name:args;name2:args2" (no spaces inside one
  # argument), AB_ARGS common to every run; writes decode-ab-<name>.json|.log
  IFS=';' read -ra runs <<< "${AB_RUNS:-}"
  for run in "${runs[@]}"; do
    name=${run%%:*}; extra=${run#*:}
    timeout ${AB_TIMEOUT:-110} python3 benchmarks/decode.py ${AB_ARGS:-} $extra --out "$OUT/decode-ab-$name.json" \
      > "$OUT/decode-ab-$name.log" 2>&1
    echo "== $name: $extra"; tail -7 "$OUT/decode-ab-$name.log"
  done
fi
exit $rc
