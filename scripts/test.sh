#!/usr/bin/env bash
# `make test` (CI's command): every stage of the cpu pipeline AND the test suite, side by side on the machine's cores.
#   0. first the lint (`make lint`: ruff check src tests, pyproject.toml's [tool.ruff]); a violation stops here, in
#      seconds, before the pipeline starts;
#   1. the cpu pipeline with config/overlays/test.yaml (reduced sizes and repetitions, the same cases and checks) into
#      its own results dir (results/test: the published results/cpu are never timed beside the suite);
#   2. the SLURM profile's test (tests/test_slurm_profile.py: it mostly waits on a real SLURM cluster's jobs);
#   3. the rest of the suite on every core, less the tests marked covered_by_stage (a stage case asserts the same
#      behaviour) or slow;
#   once the pipeline ends, tests/test_stage_results.py: every stage's result present, ok and current for this code, every case a
#   covered_by_stage test names passed, and nothing left in the pipeline's own TMPDIR (a fresh directory: every
#   stage and the processes it starts make their temporary files there through `tempfile`).
#   KMESH_TEST_RESULTS  results dir of the test run's pipeline (default: results/test)
#   KMESH_TEST_OVERLAY  its overlay over the cpu profile (default: config/overlays/test.yaml)
#   KMESH_SUITE_NICE    the suite's niceness beside the pipeline (default 0: equal shares)
#   KMESH_TEST_WORKERS  the suite's pytest-xdist workers (default: one per core, at most 4; 1: one process)
#   args                passed to the suite's pytest run (e.g. -x); `make test-all` runs the whole suite alone
set -uo pipefail
# One torch (OpenMP) thread per process: the pipeline's stage, the suite and the processes each starts share 2 cores,
# and a second intra-op thread per process only spin-waits against them (measured on the 2-core machine: the
# equivalence stage alone 153 -> 104 CPU-s and 122 -> 106 s; make test 586 -> 553 s). Results and checks are the
# same. Snakemake exports each job's declared threads as OMP_NUM_THREADS, so the pipeline below is capped to one
# (--max-threads 1; make pipeline's stages declare 2, workflow/rules/common.smk).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
results="${KMESH_TEST_RESULTS:-results/test}"
overlay="${KMESH_TEST_OVERLAY:-config/overlays/test.yaml}"
mkdir -p "$results"
console="$results/pipeline-console.log"
slurm_log="$results/slurm-test.log"
start=$(date +%s)

echo "[kmesh] make test: lint (ruff check src tests)"
if ! python -m ruff check src tests; then
  echo "[kmesh] make test: lint failed, nothing else ran (\`ruff check --fix src tests\` fixes what it marks [*])"
  exit 1
fi

# Which host this is, and how fast its cores are (kmesh.hostspeed): make test's time differs by more than half
# between the hosts a "2-core machine" can be
echo "[kmesh] make test: host: $(python -m kmesh host-speed --out "$results/host.json")"

# /tmp, not under results: the ownership stage's foreign-uid case needs a parent every user can traverse
stage_tmp=$(mktemp -d /tmp/kmesh-stage-tmp.XXXXXX) && chmod 755 "$stage_tmp"
TMPDIR="$stage_tmp" python -m kmesh pipeline --cores all --max-threads "$OMP_NUM_THREADS" --config "results_dir=$results" "overlay=$overlay" \
  > "$console" 2>&1 &
pipeline=$!
python -m pytest -q -p no:cacheprovider -m slurm tests/test_slurm_profile.py > "$slurm_log" 2>&1 &
slurm=$!
# The suite at the pipeline's CPU priority (KMESH_SUITE_NICE, default 0). At niceness 5 it ended last (clean clone,
# b7071ed: the suite 16 min 33 s, the pipeline 13 min 13 s): once peers left the chain's end the pipeline keeps both
# cores busy, and the suite, one test at a time, is the longer chain.
# On every core (pytest-xdist, KMESH_TEST_WORKERS, default one per core up to 4, each worker holding ~1-2 GB; 1: no
# workers, one process): one test at a time left a core idle once the pipeline ended, and the suite was make test's
# longer chain. `--dist loadfile` keeps a module's tests, and its module fixtures, on one worker.
cores=$(nproc --all)   # --all: nproc alone honours the OMP_NUM_THREADS=1 exported above
workers="${KMESH_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
[[ "$workers" == 1 ]] && parallel=() || parallel=(-n "$workers" --dist loadfile)
# KMESH_SUITE_MODEL_OVERLAY: the suite's tests on SmolLM2's real weights load the whole model the pipeline's model
# stage converts (tests/smollm2_model.py), so make test converts the GGUF once, not twice.
KMESH_STAGES_RUN_BESIDE=1 KMESH_REQUIRE_VLLM=1 KMESH_SUITE_MODEL_OVERLAY="$overlay" nice -n "${KMESH_SUITE_NICE:-0}" \
  python -m pytest -q -m "not slurm and not slow" \
  "${parallel[@]}" --ignore=tests/test_stage_results.py --ignore=tests/test_slurm_profile.py "$@" &
suite_pid=$!
# The stage results are checked as soon as the pipeline ends, beside whatever of the suite is still running.
wait "$pipeline"
stages=$?
KMESH_REQUIRE_STAGES=cpu KMESH_STAGE_RESULTS="$results" KMESH_STAGE_OVERLAY="$overlay" KMESH_STAGE_TMPDIR="$stage_tmp" \
  python -m pytest -q -p no:cacheprovider tests/test_stage_results.py > "$results/stage-results.log" 2>&1
checked=$?
wait "$suite_pid"
suite=$?
wait "$slurm"
slurm_rc=$?
echo "--- the pipeline beside the suite ($console) ---"
cat "$console"
echo "--- the stage results, checked when the pipeline ended ($results/stage-results.log) ---"
if ((checked)); then cat "$results/stage-results.log"; else tail -n 1 "$results/stage-results.log"; fi
rm -rf "$stage_tmp"
# Last, so that a CI page showing only the output's tail shows why the SLURM test failed (CI at f770335 showed only
# "slurm test exit 1": its tail was printed before the pipeline's console and cut).
echo "--- the SLURM profile's test beside the suite ($slurm_log) ---"
if ((slurm_rc)); then tail -n 60 "$slurm_log"; else tail -n 3 "$slurm_log"; fi
echo "[kmesh] make test: suite exit $suite, slurm test exit $slurm_rc, pipeline exit $stages," \
  "stage results exit $checked, $(( $(date +%s) - start )) s"
exit $(( suite || slurm_rc || stages || checked ))
