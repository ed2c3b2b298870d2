#!/usr/bin/env bash
# One device call for issue 23 (data path): the one-launch, host-planned restore (kmesh.kv.gather).
# Builds the kernels; GPU tests of kmesh.kv.restore and kmesh.kv.gather (kernel == torch path byte for byte, zero
# host syncs); the cuda synthetic stage (the kernel against the independent references); the cuda restore_bench
# stage (shapes + the child-restore case; tunable variants timed beside the default); then the stages whose child
# path restores through it ($STAGES, default equivalence storage; model first, each with a time limit).
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
  tests/test_restore.py tests/test_restore_gather.py tests/test_segments_arrival.py > "$out/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$out/pytest_gpu.txt"
python3 -m kmesh run synthetic --profile cuda --out /tmp/synthetic.json >> "$out/stages.log" 2>&1
python3 -m kmesh run restore_bench --profile cuda --out "$out/restore_bench.json" \
  --set "restore_bench.variants=$VARIANTS" >> "$out/stages.log" 2>&1
# model first when a model stage follows; each stage under its own time limit
if [[ " $STAGES " =~ " "(equivalence|group|storage)" " ]]; then
  timeout 200 python3 -m kmesh run model --profile cuda --out /tmp/model.json >> "$out/stages.log" 2>&1
fi
for stage in $STAGES; do
  (time timeout 300 python3 -m kmesh run "$stage" --profile cuda --out "$out/$stage.json") >> "$out/stages.log" 2>&1
done
tail -n 3 "$out/pytest_gpu.txt"; grep -E "^\[kmesh\] [a-z_]+ \(cuda\)|^real" "$out/stages.log"
