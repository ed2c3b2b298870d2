#!/usr/bin/env bash
# One device call for issue 22: the cuda equivalence stage, now with the RAG-shaped frontier (cases rag-*: full,
# naive, stock, stock-matched, repair x3, epic x3 on 4096-token RAG prompts, every arm's prefill one CUDA graph
# verified equal to eager, the end-to-end arm through a real service) beside the ttft-4096 / ttft-16384 cases.
# Builds the kernels and the model first; the stage under its own time limit. With GROUP=1 the cuda group stage
# runs after it (its scaling and the RAG-shaped scaling, group.rag), also under a time limit. With DIAG=1 the
# layer_step_pair diagnostic (eager vs compiled layer step, graphs of both arms at 4k and 16k) runs before the stage.
# With RAG16K=1 the 16k RAG variant of the stage runs after it; with SL=1 the service_load diagnostic (4k, 16k).
#   run: bash scripts/device-issue22.sh      (carry .whl: scripts/fetch-device-wheels.sh fills it)
source scripts/device-env.sh
set -o pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
} > "$out/gpu.txt" 2>&1
python3 -m kmesh run kernels --profile cuda --out "$out/kernels.json" > "$out/stages.log" 2>&1
if [ "${PYTEST:-1}" = 1 ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider --no-header -m gpu -o addopts="" ${PYTEST_FILES:-tests/test_model_runner.py \
    tests/test_group_math.py tests/test_layer_step.py tests/test_transfer.py} > "$out/pytest_gpu.txt" 2>&1
  echo "pytest rc=$?" >> "$out/pytest_gpu.txt"
fi
timeout 200 python3 -m kmesh run model --profile cuda --out /tmp/model.json >> "$out/stages.log" 2>&1
if [ -n "${DIAG:-}" ]; then
  (time timeout "${DIAG_TIMEOUT:-200}" python3 -m kmesh diagnose layer_step_pair --out "$out/layer_step_pair.json") \
    > "$out/diag.log" 2>&1
  tail -n 4 "$out/diag.log"
fi
if [ "${EQ:-1}" = 1 ]; then      # EQ=0: the diagnostics or the variants only
  (time timeout "${EQ_TIMEOUT:-420}" python3 -m kmesh run equivalence --profile cuda --out "$out/equivalence.json" \
    ${EQ_SET:+--set "$EQ_SET"}) >> "$out/stages.log" 2>&1
fi
if [ -n "${RAG16K:-}" ]; then    # the 16k RAG variant: 60 chunks, its TTFT at 4096 only (16k is the case above)
  (time timeout "${EQ16_TIMEOUT:-300}" python3 -m kmesh run equivalence --profile cuda --out "$out/equivalence-rag16k.json" \
    --set equivalence.rag.workload.chunks=60 --set equivalence.rag.workload.prompt_tokens=16384 \
    --set 'equivalence.ttft.prompt_tokens=[4096]') >> "$out/stages.log" 2>&1
fi
if [ -n "${SL:-}" ]; then        # the data path's diagnostic at 4k and 16k (py-spy where carried in .whl)
  # py-spy apart from /tmp/site: device-env's second install (KMesh, --upgrade) replaces /tmp/site/bin
  if ls .whl/py_spy-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/pyspy .whl/py_spy-*.whl
    export PATH=/tmp/pyspy/bin:$PATH
  fi
  if [ "${SL_4K:-1}" = 1 ]; then
    timeout 150 python3 -m kmesh diagnose service_load --out "$out/service_load-4k.json" >> "$out/diag.log" 2>&1
  fi
  timeout "${SL16_TIMEOUT:-200}" python3 -m kmesh diagnose service_load --set equivalence.rag.workload.chunks=60 \
    --set equivalence.rag.workload.prompt_tokens=16384 --py-spy "${SL_PYSPY:-0}" --out "$out/service_load-16k.json" \
    >> "$out/diag.log" 2>&1
fi
if [ -n "${GROUP:-}" ]; then
  (time timeout "${GROUP_TIMEOUT:-240}" python3 -m kmesh run group --profile cuda --out "$out/group.json") \
    >> "$out/stages.log" 2>&1
fi
tail -n 3 "$out/pytest_gpu.txt" 2>/dev/null; grep -E "^\[kmesh\] [a-z_]+ \(cuda\)|^real|Error" "$out/stages.log" | tail -n 20
