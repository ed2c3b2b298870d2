#!/usr/bin/env bash
# One device call for issue 11 (integrity, items 1-4): build the kernels, the GPU tests of kmesh.integrity, then the
# integrity stage on the cuda profile. Everything it keeps goes to $OUT.
#   run (device tool, carry [".whl"]; .whl must hold blake3==1.0.11 for cp312, see scripts/fetch-device-wheels.sh):
#     bash scripts/device_integrity.sh
source scripts/device-env.sh
set -o pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out" results/cuda/logs
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c 'import torch, cupy, blake3; print("torch", torch.__version__, "cupy", cupy.__version__, "blake3", blake3.__version__)'
} 2>&1 | tee "$out/gpu.txt"
python3 -c 'import blake3' 2>/dev/null || { echo "no blake3 package: add blake3==1.0.11 (cp312) to .whl" | tee -a "$out/gpu.txt"; exit 3; }
python3 -m kmesh run kernels --profile cuda --out "$out/kernels.json" 2>&1 | tail -4
for k in sha256 sha256_tree blake3; do
  cuobjdump --dump-resource-usage results/cuda/kernels/$k.cubin 2>/dev/null | grep -E "Function|REG" | tee -a "$out/gpu.txt"
done
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_integrity_gpu.py 2>&1 | tail -25 \
  | tee "$out/pytest_gpu_integrity.txt"
start=$EPOCHREALTIME
timeout 300 python3 -m kmesh run integrity --profile cuda --out results/cuda/integrity/result.json \
  > results/cuda/logs/integrity.log 2>&1; rc=$?
echo "integrity rc=$rc $(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN{print b-a}') s" | tee -a "$out/gpu.txt"
tail -5 results/cuda/logs/integrity.log
cp results/cuda/integrity/result.json "$out/integrity.json" 2>/dev/null
cp results/cuda/logs/integrity.log "$out/integrity.log"
python3 -m kmesh render --profile cuda > /dev/null 2>&1
tar czf "$out/integrity-tables.tgz" results/cuda/tables/integrity_* results/cuda/plots/integrity_* 2>/dev/null
python3 - <<'PY' 2>&1 | tee -a "$out/gpu.txt"
import json
s = json.load(open("results/cuda/integrity/result.json"))["summary"]
print("digests_match", s.get("digests_match"), "best_chunk_bytes", s.get("best_chunk_bytes"), "ok", s.get("ok"))
for arm, v in s.get("arms", {}).items():
    print(f"{arm:24s}", "  ".join(f"{k}: {r['median_ms']:.4f} ms {r['gbps']:.1f} GB/s" for k, r in v.items()))
for g, v in s.get("goals", {}).items():
    print("goal", g, v)
PY
exit $rc
