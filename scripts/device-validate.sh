#!/usr/bin/env bash
# The whole cuda profile on the GPU machine, without Snakemake (it is not installed there):
# doctor, every stage in pipeline order, the report, and the GPU-marked tests. Results go to $OUT
# (at most 8 files come back: a tarball of results/cuda with the stage logs, doctor, a stage table, the GPU tests).
#   run (device tool, carry [".whl"]): bash scripts/device-validate.sh
source scripts/device-env.sh
set -o pipefail
out=${OUT:-/tmp/out}; logs=results/cuda/logs; mkdir -p "$out" "$logs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m kmesh doctor --json > "$out/doctor.json" 2>&1; python3 -m kmesh doctor 2>&1 | tail -14
for stage in sources kernels model synthetic drain ownership equivalence storage integrity group vllm restore_bench report; do
  start=$EPOCHREALTIME
  python3 -m kmesh run "$stage" --profile cuda > "$logs/$stage.log" 2>&1; rc=$?
  printf '%-10s rc=%s %6.1fs  %s\n' "$stage" "$rc" "$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN{print b-a}')" \
    "$(grep -h '^\[kmesh\] '"$stage" "$logs/$stage.log" | tail -1)" | tee -a "$out/stages.txt"
done
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors $(grep -l "mark.gpu" tests/*.py) 2>&1 | tail -15 | tee "$out/pytest_gpu.txt"
tar czf "$out/results-cuda.tgz" results/cuda
cat "$out/stages.txt"
