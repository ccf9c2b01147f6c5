#!/usr/bin/env bash
# What the device tool runs on nvidia-h200-x2 (carry .whl: the Iris wheels). Stages (one argument,
# default all; "tests+paths" runs both):
#   tests   the GPU test suite, torchrun -m pytest -m gpu tests/gpu (PYTEST_K: a -k expression;
#           PYTEST_ARGS is split on spaces; TESTS_TIMEOUT)
#   bench   python -m commfuse bench ops (BENCH_ARGS, BENCH_TIMEOUT), into $OUT/ops.json
#   tuned   python -m commfuse bench ops --tuned: the rules' and the tuned choice per shape (TUNED_ARGS,
#           TUNED_TIMEOUT), into $OUT/ops_tuned.json
#   tune    python -m commfuse tune --model $TUNE_MODEL (default dtensor), then tune --show (TUNE_TIMEOUT)
#   model   python -m commfuse bench model (MODEL_NAME: the file names, MODEL_ARGS, MODEL_TIMEOUT)
#   paths   benchmarks/path_sweep.py (PATHS_NAME: the file names, PATHS_ARGS, PATHS_TIMEOUT)
#   all     tests, then bench
# Multicast stays off (NVLS, symmetric memory, NVSHMEM). Logs and JSON land in $OUT (default
# benchmarks/results/h200x2). The device's git may report a stale commit: set COMMFUSE_COMMIT=<the
# tree's commit> for the JSON records.
set -uo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  echo "usage: bash benchmarks/device_h200x2.sh [STAGE]"
  echo "stages: tests | bench | tuned | tune | model | paths | tests+paths | all (default all)"
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/h200x2}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . \
  || exit 1
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'GPUs')"
nvidia-smi topo -m | head -5
STAGE=${1:-all}
RUN="torchrun --nproc_per_node=2"
quiet() { grep -v "^W1130"; }  # the launcher's banner lines
if [ "$STAGE" = all ] || [ "$STAGE" = tests ] || [ "$STAGE" = tests+paths ]; then
  timeout ${TESTS_TIMEOUT:-420} $RUN -m pytest -m gpu tests/gpu -q -p no:cacheprovider --timeout 120 \
    ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | grep -vE "^\s*$" | tail -40
fi
if [ "$STAGE" = paths ] || [ "$STAGE" = tests+paths ]; then
  timeout ${PATHS_TIMEOUT:-300} $RUN benchmarks/path_sweep.py --out "$OUT/${PATHS_NAME:-paths}.json" \
    ${PATHS_ARGS:-} 2>&1 | tee "$OUT/${PATHS_NAME:-paths}.log" | quiet | tail -40
fi
if [ "$STAGE" = model ]; then
  NAME=${MODEL_NAME:-model}
  timeout ${MODEL_TIMEOUT:-560} $RUN -m commfuse bench model --out "$OUT/$NAME.json" ${MODEL_ARGS:-} 2>&1 \
    | tee "$OUT/$NAME.log" | quiet | tail -20
fi
if [ "$STAGE" = tune ]; then
  export COMMFUSE_CACHE_DIR=${COMMFUSE_CACHE_DIR:-$OUT/tune_cache}
  timeout ${TUNE_TIMEOUT:-500} $RUN -m commfuse tune --model ${TUNE_MODEL:-dtensor} 2>&1 | tee "$OUT/tune.log" | quiet | tail -20
  python3 -m commfuse tune --show 2>&1 | tee -a "$OUT/tune.log" | tail -60
fi
if [ "$STAGE" = tuned ]; then
  timeout ${TUNED_TIMEOUT:-500} $RUN -m commfuse bench ops --tuned --out "$OUT/ops_tuned.json" ${TUNED_ARGS:-} 2>&1 \
    | tee "$OUT/ops_tuned.log" | quiet | tail -45
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  timeout ${BENCH_TIMEOUT:-400} $RUN -m commfuse bench ops --out "$OUT/ops.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/ops.log" | tail -45
fi
