#!/usr/bin/env bash
# What the device tool runs on nvidia-h200-x2 (carry .whl): GPU tests, the ops benchmark (stages
# tests|bench|all), the exchange tuning (tune), the model benchmark (model) and the path sweep
# (paths, or tests+paths). PYTEST_K: a pytest -k expression (PYTEST_ARGS is split on spaces).
# Logs and JSON land in $OUT (or benchmarks/results/h200x2 when OUT is unset). The device's git may
# report a stale commit: pass COMMFUSE_COMMIT=<the tree's commit> for the JSON records.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/h200x2}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . \
  || exit 1
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'GPUs')"
nvidia-smi topo -m | head -5
STAGE=${1:-all}
if [ "$STAGE" = tune ]; then timeout 500 torchrun --nproc_per_node=2 -m commfuse.bench tune 2>&1 | tee "$OUT/tune.log" | grep -v "^W1130" | tail -12; fi
if [ "$STAGE" = all ] || [ "$STAGE" = tests ] || [ "$STAGE" = tests+paths ]; then
  timeout ${TESTS_TIMEOUT:-420} torchrun --nproc_per_node=2 -m pytest -m gpu tests/gpu -q -p no:cacheprovider --timeout 120 \
    ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | grep -vE "^\s*$" | tail -40
fi
if [ "$STAGE" = paths ] || [ "$STAGE" = tests+paths ]; then  # PATHS_NAME: the file names
  timeout ${PATHS_TIMEOUT:-300} torchrun --nproc_per_node=2 benchmarks/path_sweep.py --out "$OUT/${PATHS_NAME:-paths}.json" \
    ${PATHS_ARGS:-} 2>&1 | tee "$OUT/${PATHS_NAME:-paths}.log" | grep -v "^W1130" | tail -40
fi
if [ "$STAGE" = model ]; then  # MODEL_NAME: file names, so runs of several parts do not overwrite
  NAME=${MODEL_NAME:-model}
  timeout ${MODEL_TIMEOUT:-560} torchrun --nproc_per_node=2 -m commfuse.bench model --out "$OUT/$NAME.json" ${MODEL_ARGS:-} 2>&1 | tee "$OUT/$NAME.log" | grep -v "^W1130" | tail -20
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  timeout ${BENCH_TIMEOUT:-400} torchrun --nproc_per_node=2 -m commfuse.bench ops --out "$OUT/ops.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/ops.log" | tail -45
fi
