#!/usr/bin/env bash
# One device call for issue 9: decode reproducibility under CUDA-context churn, the runner's GPU tests, the cuda
# equivalence stage. PROFILE=1 adds the blend profile and the restore breakdown. Results under $OUT.
source scripts/device-env.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
export CUBLAS_WORKSPACE_CONFIG=:4096:8
timeout 150 python3 -m kmesh diagnose decode_isolation --out "$out/decode_isolation.json" --runs ${DECODE_RUNS:-8} > "$out/decode_isolation.log" 2>&1; echo "decode rc=$?"
echo "runs with tokens equal to run 0: $(grep -c "'tokens_equal': True" "$out/decode_isolation.log"), differing: $(grep -c "'tokens_equal': False" "$out/decode_isolation.log"), prefill differing: $(grep -c "'prefill_equal': False" "$out/decode_isolation.log")"
if [[ -n "${PROFILE:-}" ]]; then
  timeout 120 python3 -m kmesh diagnose blend_profile --out "$out/blend_profile.json" > "$out/blend_profile.log" 2>&1; echo "profile rc=$?"
  timeout 90 python3 -m kmesh diagnose restore_breakdown --out "$out/restore_breakdown.json" > /dev/null 2>&1; echo "restore rc=$?"
fi
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_model_runner.py tests/test_attention_triton.py tests/test_restore.py 2>&1 | tail -3 | tee "$out/pytest_gpu.txt"
start=$EPOCHREALTIME
timeout 200 python3 -m kmesh run equivalence --profile cuda --out "$out/equivalence.json" > "$out/equivalence.log" 2>&1; echo "equivalence rc=$? $(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN{print b-a}')s"
tail -4 "$out/equivalence.log"
