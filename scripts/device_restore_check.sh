#!/usr/bin/env bash
# One device call for §21 (issue 3): build kernels, run the cuda-profile synthetic stage, the GPU tests of
# kmesh.kv.restore, and the restore benchmark (stage restore_bench). Everything it keeps goes to $OUT (6 files).
#   run: bash scripts/device_restore_check.sh          (carry .whl, and .whl-test for pytest)
#   VARIANTS=",-DRESTORE_ROT_CHUNK=16" bash scripts/device_restore_check.sh   # first entry = default build
# Tuning variants are compiled on the fly (or taken from a carried results/.kernel-cache); each must pass
# the same synthetic stage and GPU tests as the default build before the benchmark times it.
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
    echo "$f: 128-bit global loads/stores: $(cuobjdump --dump-sass -fun $f $cub | grep -cE '(LDG|STG)\.E\.(EL\.)?128|\.128 ')," \
         "local memory ops: $(cuobjdump --dump-sass -fun $f $cub | grep -cE '(LDL|STL)')"
  done | tee -a "$out/gpu.txt"
fi
# default list: the two combinations not yet timed (docs/measurements/restore_h200.md, "What the variants say")
VARIANTS=${VARIANTS:-",-DRESTORE_ROT_CHUNK=16,-DRESTORE_FP8_STREAMING=1"}
IFS=',' read -ra VS <<< "$VARIANTS"
[ -n "${VS[0]}" ] && { echo "the first variant must be the default build (empty flags)"; exit 2; }
# One Python process validates every variant (synthetic stage + GPU tests, each with the variant's flags):
# saves an interpreter and torch start per check. Writes the validated variants, one per line.
VARIANTS="$VARIANTS" OUTDIR="$out" python3 - <<'PY' 2>&1 | tee "$out/variants.txt"
import os, pytest
from kmesh.cli import main as kmesh
with open("/tmp/validated.txt", "w") as ok:
    for v in os.environ["VARIANTS"].split(","):
        os.environ["KMESH_KERNEL_FLAGS"] = v
        print(f"== variant: {v or 'default'}", flush=True)
        s = kmesh(["run", "synthetic", "--profile", "cuda", "--out",
                   os.environ["OUTDIR"] + "/synthetic.json" if not v else "/tmp/synthetic_variant.json"])
        p = pytest.main(["-q", "-p", "no:cacheprovider", "--no-header", "tests/test_restore.py", "-k", "kernel"])
        if s == 0 and p == 0:
            ok.write(v + "\n")
            print("   validated", flush=True)
        else:
            print(f"   FAILED (synthetic rc={s}, pytest rc={int(p)}): not timed", flush=True)
PY
[ -s /tmp/validated.txt ] && [ -z "$(head -1 /tmp/validated.txt)" ] || { echo "default build failed validation: no timing"; exit 1; }
mapfile -t ok < /tmp/validated.txt
variants=$(printf '"%s",' "${ok[@]}")
echo "timing validated variants: [${variants%,}]"
# The restore_bench stage times them (BENCH_ARGS: more --set overrides, e.g. "--set restore_bench.pairs=15");
# its result file and bandwidth table (kmesh render) are kept as bench_restore.json / bench_restore.md.
python3 -m kmesh run restore_bench --profile cuda --set "restore_bench.variants=[${variants%,}]" ${BENCH_ARGS:-} \
  2>&1 | tail -8; rc=$?
cp results/cuda/restore_bench/result.json "$out/bench_restore.json"
python3 -m kmesh render --profile cuda > /dev/null && cp results/cuda/tables/restore_bench_bandwidth.md "$out/bench_restore.md" \
  && cat "$out/bench_restore.md"
exit $rc
