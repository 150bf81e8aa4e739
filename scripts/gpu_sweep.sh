#!/usr/bin/env bash
# The whole NVFP4 build-check-benchmark sweep in one device call.
#
#   scripts/gpu_sweep.sh [stages]      stages: comma-separated subset of env,build,test,kernels,decode
#                                      (default: all of them, in that order)
#
# Writes under $OUT (default /tmp/jaxlp_sweep): env.txt, build.txt, pytest_gpu.txt,
# bench_nvfp4.json + nvfp4_dispatch.json + bench_nvfp4.txt, bench_decode.json + bench_decode.txt;
# prints a short summary last. Budgets (seconds) for the two benchmarks: KERNEL_BUDGET,
# DECODE_BUDGET; extra arguments: KERNEL_ARGS, DECODE_ARGS; DECODE_XLA_FLAGS: XLA_FLAGS of the
# decode benchmark alone; MERGE=1: merge the measured shapes into jaxlp/ffi/nvfp4_dispatch.json (this
# GPU model's entry; other GPUs' entries are kept); TEST_PATHS: the pytest targets (default: tests/ffi and
# tests/test_nvfp4_dispatch.py), TEST_TIMEOUT its limit. A library built on another machine
# with the same source, nvcc and jaxlib is reused from $JAXLP_FFI_CACHE (default .cache/jaxlp_ffi).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jaxlp_sweep}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAXLP_FFI_CACHE=${JAXLP_FFI_CACHE:-$PWD/.cache/jaxlp_ffi}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
PY=${PY:-python3}
STAGES=${1:-env,build,test,kernels,decode}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

if has env; then
  stamp env
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; which nvcc; nvcc --version | tail -1
    $PY -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"; } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
fi

if has build; then
  stamp build
  $PY -c "from jaxlp.ffi import build, nvfp4; p = build.library_path('nvfp4_gemv'); print('cached' if p.is_file() else 'building', p); print(build.build('nvfp4_gemv', verbose=True)); nvfp4.load(); print('registered')" > "$OUT/build.txt" 2>&1
  tail -3 "$OUT/build.txt"
fi

if has test; then
  stamp test
  # Several pytest workers share the GPU: no preallocation. STRICT=1: no benchmarks after a failure.
  if ! XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-240}" $PY -m pytest -q -p no:cacheprovider \
      -n "${TEST_WORKERS:-4}" ${TEST_PATHS:-tests/ffi tests/test_nvfp4_dispatch.py} > "$OUT/pytest_gpu.txt" 2>&1; then
    grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_gpu.txt" | head -30
    tail -3 "$OUT/pytest_gpu.txt"
    if [ "${STRICT:-0}" = 1 ]; then stamp "GPU tests failed: no benchmarks"; exit 1; fi
    stamp "GPU tests failed (going on: the benchmark's spot checks show which kernels are wrong)"
  fi
  tail -3 "$OUT/pytest_gpu.txt"
fi

if has kernels; then
  stamp kernels
  # MERGE=1: measured shapes replace theirs in the repository's table (same device), which the
  # decode stage then uses; a copy goes to $OUT. Otherwise the table of this run alone, in $OUT.
  if [ "${MERGE:-0}" = 1 ]; then TABLE=jaxlp/ffi/nvfp4_dispatch.json; MERGE_ARG=--merge; else TABLE="$OUT/nvfp4_dispatch.json"; MERGE_ARG=; fi
  $PY scripts/bench_nvfp4.py --out "$OUT/bench_nvfp4.json" --table "$TABLE" $MERGE_ARG \
    --budget-s "${KERNEL_BUDGET:-300}" ${KERNEL_ARGS:-} > "$OUT/bench_nvfp4.txt" 2>&1
  [ "$TABLE" != "$OUT/nvfp4_dispatch.json" ] && cp "$TABLE" "$OUT/nvfp4_dispatch.json"
  tail -5 "$OUT/bench_nvfp4.txt"
fi

if has decode; then
  stamp decode
  XLA_FLAGS="${DECODE_XLA_FLAGS-${XLA_FLAGS:-}}" $PY scripts/bench_decode.py --out "$OUT/bench_decode.json" \
    --budget-s "${DECODE_BUDGET:-200}" ${DECODE_ARGS:-} > "$OUT/bench_decode.txt" 2>&1
fi

stamp summary
[ -f "$OUT/pytest_gpu.txt" ] && tail -2 "$OUT/pytest_gpu.txt"
[ -f "$OUT/bench_nvfp4.txt" ] && sed -n '/^## /,$p' "$OUT/bench_nvfp4.txt"
[ -f "$OUT/bench_decode.txt" ] && sed -n '/^## /,$p' "$OUT/bench_decode.txt" | tail -20
[ -f "$OUT/bench_decode.txt" ] && grep -E "Error|error" "$OUT/bench_decode.txt" | tail -3
stamp done
