#!/usr/bin/env bash
# One device call for issue 23 (data path), part 1: the one-launch, host-planned restore (kmesh.restore_gather).
# Builds the kernels, runs the GPU tests of kmesh.restore and kmesh.restore_gather (kernel == torch path byte for
# byte, zero host syncs), the cuda synthetic stage (the kernel against the independent references) and the cuda
# restore_bench stage (shapes + the child-restore case; extra tunable variants timed beside the default).
#   run: bash scripts/device-issue23.sh      (carry .whl: scripts/fetch-device-wheels.sh fills it)
source scripts/device-env.sh
set -o pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
{
  git rev-parse HEAD 2>/dev/null || echo "no git"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
} > "$out/gpu.txt" 2>&1
python3 -m kmesh run kernels --profile cuda --out "$out/kernels.json" > "$out/stages.log" 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider --no-header -m gpu -o addopts="" \
  tests/test_restore.py tests/test_restore_gather.py > "$out/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$out/pytest_gpu.txt"
python3 -m kmesh run synthetic --profile cuda --out "$out/synthetic.json" >> "$out/stages.log" 2>&1
python3 -m kmesh run restore_bench --profile cuda --out "$out/restore_bench.json" \
  --set 'restore_bench.variants=["", "-DRESTORE_FP8_STREAMING=1", "-DRESTORE_ROT_CHUNK=16"]' >> "$out/stages.log" 2>&1
echo "restore_bench rc=$?" >> "$out/stages.log"
tail -n 3 "$out/pytest_gpu.txt"; cat "$out/stages.log" | grep -E "^\[kmesh\]" | tail -12
