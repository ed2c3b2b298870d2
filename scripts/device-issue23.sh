#!/usr/bin/env bash
# One device call for issue 23 (data path): the one-launch, host-planned restore (kmesh.restore_gather).
# Builds the kernels; GPU tests of kmesh.restore and kmesh.restore_gather (kernel == torch path byte for byte, zero
# host syncs); the cuda synthetic stage (the kernel against the independent references); the cuda restore_bench
# stage (shapes + the child-restore case; tunable variants timed beside the default); then the stages whose child
# path now restores through it: model -> equivalence, storage (each with a time limit).
#   run: bash scripts/device-issue23.sh      (carry .whl: scripts/fetch-device-wheels.sh fills it)
#   VARIANTS='["", "-DRESTORE_FP8_STREAMING=0"]' STAGES="equivalence storage" bash scripts/device-issue23.sh
source scripts/device-env.sh
set -o pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
VARIANTS=${VARIANTS:-'[""]'}
STAGES=${STAGES:-"equivalence storage"}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
} > "$out/gpu.txt" 2>&1
python3 -m kmesh run kernels --profile cuda --out "$out/kernels.json" > "$out/stages.log" 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider --no-header -m gpu -o addopts="" \
  tests/test_restore.py tests/test_restore_gather.py > "$out/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$out/pytest_gpu.txt"
python3 -m kmesh run synthetic --profile cuda --out /tmp/synthetic.json >> "$out/stages.log" 2>&1
python3 -m kmesh run restore_bench --profile cuda --out "$out/restore_bench.json" \
  --set "restore_bench.variants=$VARIANTS" >> "$out/stages.log" 2>&1
if [[ " $STAGES " == *" equivalence "* ]]; then
  timeout 200 python3 -m kmesh run model --profile cuda --out /tmp/model.json >> "$out/stages.log" 2>&1
  (time timeout 300 python3 -m kmesh run equivalence --profile cuda --out "$out/equivalence.json") >> "$out/stages.log" 2>&1
fi
if [[ " $STAGES " == *" storage "* ]]; then
  (time timeout 240 python3 -m kmesh run storage --profile cuda --out "$out/storage.json") >> "$out/stages.log" 2>&1
fi
tail -n 3 "$out/pytest_gpu.txt"; grep -E "^\[kmesh\] [a-z_]+ \(cuda\)|^real" "$out/stages.log"
