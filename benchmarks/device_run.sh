#!/usr/bin/env bash
# The one script a device call runs (issue 6): GPU tests, then the decode benchmark.
# Carry: .whl (xgrammar + deps as wheels) and .bench (the Tekken-131k tokenizer, tgz).
#   run: bash benchmarks/device_run.sh [tests|bench|all] [extra decode.py args...]
# Writes under $OUT: env.txt, tests.log, junit.xml, bench.log, decode-h200.json.
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} || { echo "wheel install failed"; exit 1; }
mkdir -p /tmp/tok && tar xzf .bench/tekken_131k.tgz -C /tmp/tok && export STRUCTGEN_TEKKEN_DIR=/tmp/tok/tekken_131k
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  python3 - <<'PY'
import torch, triton, xgrammar
from cuda.bindings import driver as cu
cu.cuInit(0)
dev = cu.cuDeviceGet(0)[1]
A = cu.CUdevice_attribute
for name in ("CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR", "CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM",
             "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES", "CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED"):
    if hasattr(A, name):
        print(name, cu.cuDeviceGetAttribute(getattr(A, name), dev)[1])
print("torch", torch.__version__, "triton", triton.__version__, "xgrammar", xgrammar.__version__ if hasattr(xgrammar, "__version__") else "?")
PY
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  timeout 240 python3 -m pytest -p no:cacheprovider -m gpu ${TESTS:-tests/gpu} -v -s --timeout=150 \
    --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|round trip|passed|failed|Error|error" | tail -40
  rc=$?
fi
if [[ $what == bench || $what == all ]]; then
  timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/decode.py --out "$OUT/decode-h200.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -45
fi
exit $rc
