#!/usr/bin/env bash
# `make check`: every stage of the cpu pipeline AND the test suite, side by side (not yet CI's command: too slow
# for its 12 min budget on 2 cores).
# Stages run one at a time (--cores 1, each stage single-threaded as Snakemake runs it) into their own results dir
# (results/test by default, so the published results/cpu are never timed beside the suite), while pytest uses the
# other core; then tests/test_stage_results.py checks every stage's result: present, ok, current for this code.
#   KMESH_TEST_RESULTS  results dir of the test run's pipeline (default: results/test)
#   KMESH_TEST_OVERLAY  its overlay over the cpu profile (default: config/overlays/test.yaml: fewer timed pairs)
#   args                passed to the first pytest run (e.g. tests/test_bench.py -x)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
results="${KMESH_TEST_RESULTS:-results/test}"
overlay="${KMESH_TEST_OVERLAY:-config/overlays/test.yaml}"   # fewer timed repetitions, same cases and checks
mkdir -p "$results"
console="$results/pipeline-console.log"

python -m kmesh pipeline --cores 1 --config "results_dir=$results" "overlay=$overlay" > "$console" 2>&1 &
pipeline=$!
KMESH_REQUIRE_VLLM=1 python -m pytest -q --ignore=tests/test_stage_results.py "$@"
suite=$?
wait "$pipeline"
stages=$?
echo "--- the pipeline beside the suite ($console) ---"
cat "$console"
KMESH_REQUIRE_STAGES=cpu KMESH_STAGE_RESULTS="$results" KMESH_STAGE_OVERLAY="$overlay" python -m pytest -q tests/test_stage_results.py
checked=$?
echo "[kmesh] make test: suite exit $suite, pipeline exit $stages, stage results exit $checked"
exit $(( suite || stages || checked ))
