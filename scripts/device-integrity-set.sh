#!/usr/bin/env bash
# One device call for issue 23 item 3 (integrity in one launch per request): kernels, the GPU tests of
# kmesh.integrity, `kmesh diagnose gpu_hash_overhead` (every request path, paired), then the integrity stage (cuda).
#   run (device tool, carry [".whl"]): bash scripts/device-integrity-set.sh
source scripts/device-env.sh
set -o pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out" results/cuda/logs
rev=${KMESH_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}   # the device copy's .git can be stale: pass KMESH_REV
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c 'import torch, cupy, blake3; print("torch", torch.__version__, "cupy", cupy.__version__, "blake3", blake3.__version__)'
} 2>&1 | tee "$out/gpu.txt"
python3 -m kmesh run kernels --profile cuda --out "$out/kernels.json" 2>&1 | tail -3
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_integrity_gpu.py 2>&1 | tail -25 \
  | tee "$out/pytest_gpu-$rev.txt"
timeout 240 python3 -m kmesh diagnose gpu_hash_overhead --reps 50 --big-reps 7 --out "$out/hash_overhead-$rev.json" \
  > "$out/hash_overhead.log" 2>&1; echo "diagnose rc=$?" | tee -a "$out/gpu.txt"
tail -3 "$out/hash_overhead.log"
timeout 240 python3 -m kmesh run integrity --profile cuda --out results/cuda/integrity/result.json \
  > results/cuda/logs/integrity.log 2>&1; rc=$?
echo "integrity rc=$rc" | tee -a "$out/gpu.txt"
tail -4 results/cuda/logs/integrity.log
cp results/cuda/integrity/result.json "$out/result-$rev.json" 2>/dev/null
python3 -m kmesh render --profile cuda > /dev/null 2>&1
cp results/cuda/tables/integrity_arms_*.md "$out/" 2>/dev/null
python3 - "$out/hash_overhead-$rev.json" <<'PY' 2>&1 | tee -a "$out/gpu.txt"
import json, sys
r = json.load(open(sys.argv[1]))
for s, algs in r["medians"].items():
    for a, paths in algs.items():
        for p, v in paths.items():
            print(f"{s:4s} {a:12s} {p:11s} issue {v['issue_us']:8.1f} event {v['event_us']:9.1f} gpu {v['gpu_only_us']:9.1f} us"
                  f"  {v['event_GBps']:8.1f} GB/s  vs passes {v['event_ratio_vs_passes']}")
PY
exit $rc
