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
# The Kubernetes executor plugin is installed apart, in $k8s_dir, off the venv's import path: Snakemake imports every
# installed executor plugin at start, and this one imports the `kubernetes` client (~2.6 CPU-s per Snakemake process:
# a third of a dry run; make test starts ~25 of them). `kmesh pipeline` puts it on the path for a run that asks for
# the kubernetes executor (docs/cluster.md). "+k8s-apart" in the stamp rebuilds a venv made before.
k8s_plugin="snakemake-executor-plugin-kubernetes"
k8s_dir="$venv/opt/snakemake-kubernetes"
want="$(sha256sum "$lock" | cut -d' ' -f1)+k8s-apart"

# pip's configured extra index is a flat folder; its per-package "ignored" warnings are noise.
quiet_pip() { "$venv/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
  echo "[setup-env] $venv is current (lock $want)"
else
  echo "[setup-env] building $venv from $lock (first time: ~1 min)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # uv installs the lock: its Rust installer unpacks the lock's 3.8 GB on every core (2-core machine, cold caches:
  # ~25 s; pip took ~85 s even in three parts side by side). uv itself comes first, from the lock's own line (pinned
  # by sha256, like every other distribution), through pip. uv reads no pip.conf: pip's configured index and
  # find-links (where this machine's torch==2.13.0+cpu lies) are handed over from `pip config list`. Not pip's extra
  # indexes: where two indexes hold different builds of one version (this machine's opencv-python-headless), uv
  # takes one without looking at the lock's hash and fails on it, where pip picks the build whose hash matches.
  uv_pin="$(grep -E '^uv==' "$lock")" || { echo "[setup-env] $lock pins no uv" >&2; exit 1; }
  quiet_pip install --quiet --require-hashes --no-deps --no-compile -r <(echo "$uv_pin")
  uv_args=()
  while IFS='=' read -r key value; do
    value="${value#\'}"; value="${value%\'}"
    case "${key##*.}" in
      index-url) uv_args+=(--index-url "$value") ;;
      find-links) for v in $value; do uv_args+=(--find-links "$v"); done ;;
    esac
  done < <("$venv/bin/python" -m pip config list 2>/dev/null)
  # --no-deps --require-hashes as with pip. Byte-code is compiled below, only for what is imported.
  main_lock="$(mktemp)" && k8s_lock="$(mktemp)"
  grep -v -E "^$k8s_plugin==" "$lock" > "$main_lock"
  grep -E "^$k8s_plugin==" "$lock" > "$k8s_lock" || { echo "[setup-env] $lock pins no $k8s_plugin" >&2; exit 1; }
  if ! "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --require-hashes --no-deps \
      "${uv_args[@]}" -r "$main_lock"; then
    # a machine whose default index lacks part of the lock: pip, with every index it is configured with
    echo "[setup-env] uv could not install $lock from pip's index and find-links (its errors above); pip instead" >&2
    if ! quiet_pip install --quiet --require-hashes --no-deps --no-compile -r "$main_lock"; then
      echo "[setup-env] installing $lock failed (see pip's errors above)" >&2
      exit 1
    fi
  fi
  # the plugin alone (its dependencies, the kubernetes client among them, are in the venv from the lock)
  if ! quiet_pip install --quiet --require-hashes --no-deps --no-compile --target "$k8s_dir" -r "$k8s_lock"; then
    echo "[setup-env] installing $k8s_plugin into $k8s_dir failed (see pip's errors above)" >&2
    exit 1
  fi
  rm -f "$main_lock" "$k8s_lock"
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
