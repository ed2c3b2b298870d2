#!/usr/bin/env bash
# One device call for §21 (issue 3): build kernels, run the cuda-profile synthetic stage, the GPU tests of
# kmesh.restore, and the restore benchmark. Everything it keeps goes to $OUT (at most 8 files).
#   run: bash scripts/device_restore_check.sh
source scripts/device-env.sh
set -o pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
# pytest for the GPU tests, carried as wheels (.whl-test); the machine's own packages stay first on the path.
if [ -d .whl-test ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-test .whl-test/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site-test"
fi
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
} 2>&1 | tee "$out/gpu.txt"
python3 -m kmesh run kernels --profile cuda --out "$out/kernels.json" 2>&1 | tail -4
cub=results/cuda/kernels/restore_rope.cubin
if command -v cuobjdump >/dev/null && [ -f "$cub" ]; then
  for f in restore_rope_bf16 restore_rope_e4m3; do
    echo "$f: 128-bit global loads/stores: $(cuobjdump --dump-sass -fun $f $cub | grep -cE '(LDG|STG)\.E\.(EL\.)?128|\.128 ')"
  done | tee -a "$out/gpu.txt"
fi
python3 -m kmesh run synthetic --profile cuda --out "$out/synthetic.json" 2>&1 | tail -15
python3 -m pytest -q -p no:cacheprovider tests/test_restore.py -k "kernel" 2>&1 | tail -8 | tee "$out/pytest_gpu.txt"
# Tuning variants (compile-time tunables of restore_rope.cu, compiled on the fly): each must pass the same
# synthetic stage and GPU tests before its timing means anything.
VARIANTS=${VARIANTS:-",-DRESTORE_U=8,-DRESTORE_U=2,-DRESTORE_FP8_CHUNK=8 -DRESTORE_FP8_X2=1"}
IFS=',' read -ra VS <<< "$VARIANTS"
for v in "${VS[@]}"; do
  [ -z "$v" ] && continue   # the default build ran above
  echo "== variant: $v"
  KMESH_KERNEL_FLAGS="$v" python3 -m kmesh run synthetic --profile cuda --out /tmp/synthetic_variant.json 2>&1 | tail -3
  KMESH_KERNEL_FLAGS="$v" python3 -m pytest -q -p no:cacheprovider tests/test_restore.py -k kernel 2>&1 | tail -1
done 2>&1 | tee "$out/variants.txt"
python3 scripts/bench_restore.py --out "$out" --variants "$VARIANTS" ${BENCH_ARGS:-} 2>&1 | tail -24
