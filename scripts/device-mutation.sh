#!/usr/bin/env bash
# A mutation set too slow for 2 cores (make mutation MUTATION_SET=NAME), run with every core of the GPU host.
# Here:   python -m kmesh.devtools.mutation_set NAME --copy-only      (results/mutation/NAME/tree, no mutmut run)
# Device: bash scripts/device-mutation.sh NAME [SECONDS [MUTANT-GLOB...]]   carry .whl and results/mutation/NAME
# mutmut runs in that tree on the CPU (CUDA hidden, as on CI; one thread per worker, a worker per core) until done or
# SECONDS (default 400), then gets SIGINT (SIGKILL 30 s later): it stops its workers and keeps every finished verdict.
# SESSION=1: one mutmut process for the whole device session instead (src/kmesh/tools/mutmut_session.py, run by
# path; mutmut's setup paid once):
# the first call starts it in its own session (setsid: it outlives the call) and watches it for SECONDS; each later
# call (within the machine's 30 s warm time, carrying nothing, so the running tree stays) only watches it. Every call
# ends with a snapshot of the verdicts (each .meta copied until it parses: mutmut may be writing it).
# The state (mutmut's per-file verdicts, its test statistics, the logs) comes back as $OUT/NAME-state.tgz: unpack it
# over results/mutation/ here, where `mutmut run` (kmesh.devtools.mutation_set) goes on with what has no verdict yet and
# the report is written (its survivors' diffs take one mutmut process each: too slow for a device call).
source scripts/device-env.sh
set -o pipefail
name=${1:?usage: device-mutation.sh SET [SECONDS]}
limit=${2:-400}
globs=("${@:3}")
out=${OUT:-/tmp/out}; mkdir -p "$out"
root=$PWD
tree=$root/results/mutation/$name/tree
[ -d "$tree" ] || { echo "no $tree: prepare it with kmesh.devtools.mutation_set $name --copy-only and carry it"; exit 2; }
cd "$tree"
jobs=${JOBS:-$(nproc --all)}        # before OMP_NUM_THREADS: nproc honours it
export PYTHONPATH=$tree/mutants/src:/tmp/site CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export KMESH_REVISION="$(cat ../REVISION)"
if [[ -n "${SESSION:-}" ]]; then
  pidf=/tmp/mutmut.pid
  if ! { [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; }; then
    echo "$(date -u +%FT%TZ) mutmut session start --max-children $jobs, $(nproc --all) cores" >> ../runs.log
    (setsid nohup python3 "$root/src/kmesh/tools/mutmut_session.py" --max-children "$jobs" "${globs[@]}" \
      >> ../mutmut.log 2>&1 < /dev/null &)
    sleep 3
  fi
  end=$((SECONDS + limit))
  while [ $SECONDS -lt $end ] && kill -0 "$(cat "$pidf" 2>/dev/null)" 2>/dev/null; do sleep 5; done
  kill -0 "$(cat "$pidf" 2>/dev/null)" 2>/dev/null && echo "mutmut still running" >> ../runs.log \
    || echo "mutmut session ended" >> ../runs.log
else
  echo "$(date -u +%FT%TZ) mutmut run --max-children $jobs, limit ${limit}s, $(nproc --all) cores" >> ../runs.log
  { time timeout -k 30 -s INT "$limit" python3 -m mutmut run --max-children "$jobs" "${globs[@]}"; } \
    >> ../mutmut.log 2>&1
  echo "mutmut rc=$?" >> ../runs.log
fi
timeout 40 python3 -m kmesh.devtools.mutation_report --out .. >> ../runs.log 2>&1
tr '\r' '\n' < ../mutmut.log | grep -a -E "mutations/second|Stopping|Failed|^real|mutmut-session" | tail -n 4 \
  >> ../runs.log
cd "$root"
parses() {   # whole once it parses (a .meta or .json file)
  [[ $1 != *.meta && $1 != *.json ]] || python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$1" 2>/dev/null
}
snap=$(mktemp -d); mkdir -p "$snap/$name"
(cd results/mutation && for f in "$name"/*.log "$name"/report.* "$name"/tree/mutants/mutmut-stats.json \
    $(find "$name/tree/mutants" -name "*.meta"); do
  [ -f "$f" ] || continue
  mkdir -p "$snap/$(dirname "$f")"
  for _ in 1 2 3 4 5 6; do     # a verdict file mutmut is rewriting: copy again until it parses
    cp "$f" "$snap/$f" && parses "$snap/$f" && break
    sleep 0.3
  done
done)
(cd "$snap" && tar -czf "$out/$name-state.tgz" "$name")
rm -rf "$snap"
tail -n 8 "results/mutation/$name/runs.log"; head -n 30 "results/mutation/$name/report.md" 2>/dev/null
