#!/usr/bin/env bash
# The liburing binding's child-process check (kmesh.storage.uring.binding_crash) on a CPU that has AVX-512 (the GPU
# machine's): the check must pass there and io_uring stay available, as it must refuse on a CPU without it.
#   run (device tool, carry [".whl"]): KMESH_REV=<rev> bash scripts/device-uring-check.sh
source scripts/device-env.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
rev=${KMESH_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
{
  grep -m1 "model name" /proc/cpuinfo
  echo "avx512f: $(grep -m1 -o -w avx512f /proc/cpuinfo || echo absent)"
  uname -r
  python3 -c "from kmesh.storage import uring; import subprocess, sys; r = subprocess.run([sys.executable, '-c', uring._SMOKE], capture_output=True, text=True); print('smoke rc', r.returncode, r.stderr[-800:])"
  python3 -c 'from kmesh.storage import uring; print("binding_crash:", uring.binding_crash()); print(uring.probe())'
  timeout 200 python3 -m pytest -q -p no:cacheprovider --no-header -o addopts="" tests/test_storage_uring.py -rs 2>&1 | tail -8
} > "$out/uring-check-$rev.txt" 2>&1
cat "$out/uring-check-$rev.txt"
