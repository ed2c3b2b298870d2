#!/usr/bin/env bash
# One device call for issue 9's open points: decode reproducibility isolation, attention kernels, restore
# breakdown, the cuda equivalence stage, the runner's GPU tests. Results under $OUT.
source scripts/device-env.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
export CUBLAS_WORKSPACE_CONFIG=:4096:8
timeout 150 python3 scripts/decode_isolation.py "$out/decode_isolation.json" 8 > "$out/decode_isolation.log" 2>&1; echo "decode rc=$?"
tail -16 "$out/decode_isolation.log"
timeout 120 python3 scripts/attention_variants.py "$out/attention_variants.json" > "$out/attention_variants.log" 2>&1; echo "attn rc=$?"
tail -3 "$out/attention_variants.log"
timeout 90 python3 scripts/restore_breakdown.py "$out/restore_breakdown.json" > "$out/restore_breakdown.log" 2>&1; echo "restore rc=$?"
tail -3 "$out/restore_breakdown.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_model_runner.py tests/test_attention_triton.py 2>&1 | tail -5 | tee "$out/pytest_gpu.txt"
start=$EPOCHREALTIME
timeout 200 python3 -m kmesh run equivalence --profile cuda --out "$out/equivalence.json" > "$out/equivalence.log" 2>&1; echo "equivalence rc=$? $(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN{print b-a}')s"
tail -4 "$out/equivalence.log"
