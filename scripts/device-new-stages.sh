#!/usr/bin/env bash
# One device call: the cuda storage and restore_bench stages and their GPU tests (results under $OUT).
source scripts/device-env.sh
out=${OUT:-/tmp/out}; mkdir -p "$out" results/cuda/logs
export CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -m kmesh run kernels --profile cuda --out results/cuda/kernels/result.json > /dev/null 2>&1
for stage in storage restore_bench; do
  start=$EPOCHREALTIME
  timeout ${LIMIT:-240} python3 -m kmesh run $stage --profile cuda --out results/cuda/$stage/result.json > results/cuda/logs/$stage.log 2>&1
  echo "$stage rc=$? $(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN{print b-a}')s"; tail -4 results/cuda/logs/$stage.log
  cp results/cuda/$stage/result.json "$out/$stage.json" 2>/dev/null; cp results/cuda/logs/$stage.log "$out/$stage.log"
done
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_storage_*.py tests/test_restore_bench.py 2>&1 | tail -8 | tee "$out/pytest_gpu.txt"
