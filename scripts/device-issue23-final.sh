#!/usr/bin/env bash
# One device call for issue 23 at one revision: kernels; GPU tests of restore / restore_gather / segments arrival /
# integrity; stages restore_bench, integrity, model, then storage twice: the profile's I/O engine (auto: io_uring)
# and io.engine=preadv (one read call per object: the reader holds no GIL while it is in flight).
#   run (device tool, carry [".whl"]): KMESH_REV=<rev> bash scripts/device-issue23-final.sh
source scripts/device-env.sh
set -o pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
rev=${KMESH_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}   # the device copy's .git can be stale
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
} > "$out/gpu.txt" 2>&1
python3 -m kmesh run kernels --profile cuda --out /tmp/kernels.json > "$out/stages-$rev.log" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider --no-header -m gpu -o addopts="" tests/test_restore.py \
  tests/test_restore_gather.py tests/test_segments_arrival.py tests/test_integrity_gpu.py > "$out/pytest_gpu-$rev.txt" 2>&1
echo "pytest rc=$?" >> "$out/pytest_gpu-$rev.txt"
for stage in restore_bench integrity model; do
  (time timeout 200 python3 -m kmesh run $stage --profile cuda --out "$out/$stage-$rev.json") >> "$out/stages-$rev.log" 2>&1
done
(time timeout 240 python3 -m kmesh run storage --profile cuda --out "$out/storage-$rev.json") >> "$out/stages-$rev.log" 2>&1
(time timeout 240 python3 -m kmesh run storage --profile cuda --set storage.io.engine=preadv \
  --out "$out/storage-preadv-$rev.json") >> "$out/stages-$rev.log" 2>&1
rm -f "$out/model-$rev.json"
tail -n 2 "$out/pytest_gpu-$rev.txt"; grep -E "^\[kmesh\] [a-z_]+ \(cuda\)|^real|FAILED" "$out/stages-$rev.log"
for f in "$out"/storage-*.json; do
python3 - "$f" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
print(sys.argv[1].rsplit("/", 1)[-1], "floor_ratio", s.get("floor_ratio"), s.get("floor_ratio_variant"), s.get("floor_ratios"))
PY
done
