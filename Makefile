# The two commands of README.md. Both set up .venv from requirements/cpu.lock first (idempotent).
SHELL := /bin/bash
VENV := .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export LMCACHE_TRACK_USAGE := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: env pipeline test check doctor lock mutation slurm-cluster

env:
	scripts/setup-env.sh

# One console line per stage as it starts and ends; Snakemake's full output: results/<profile>/logs/snakemake.log.
pipeline: env  ## run every stage on the CPU profile, then tables + plots
	python -m kmesh pipeline --cores all $(SNAKEMAKE_ARGS)

test: env  ## the test suite (CI runs exactly this)
	KMESH_REQUIRE_VLLM=1 python -m pytest -q $(PYTEST_ARGS)

# Every stage AND the whole suite: scripts/test.sh runs the cpu pipeline (config/overlays/test.yaml: fewer timed
# pairs) into results/test beside the suite, then tests/test_stage_results.py fails on a missing, stale or failed
# stage result. Not yet CI's command: on the 2-core machine it takes ~25 min (README), over the 12 min budget.
check: env  ## every stage on the cpu profile (reduced repetitions, into results/test) beside the test suite
	scripts/test.sh $(PYTEST_ARGS)

slurm-cluster:  ## a single-node SLURM cluster on this machine (root; apt-get) for the slurm profile and its test
	scripts/slurm-local.sh

doctor: env
	python -m kmesh doctor

# Not in CI (far too slow for 2 cores). mutmut keeps its results in mutants/ and retests only what changed.
MUTATION_JOBS ?= 2
mutation: env  ## mutation testing of layout, rope, restore, service registry, transfer engine (pyproject [tool.mutmut])
	$(VENV)/bin/python -m pip install --quiet --require-hashes --no-deps -r requirements/mutation.lock
	# mutants/src must exist before Python starts: a PYTHONPATH entry that is missing at start-up is cached as
	# "nothing here", and the tests (and the service processes they start) would then import the unmutated code.
	mkdir -p results/mutation mutants/src
	PYTHONPATH=$(CURDIR)/mutants/src mutmut run --max-children $(MUTATION_JOBS) > results/mutation/mutmut.log 2>&1; \
	  rc=$$?; tr '\r' '\n' < results/mutation/mutmut.log | grep -a -E "mutations/second|Stopping|failed to" | tail -3; \
	  python -m kmesh.tools.mutation_report $(MUTATION_REPORT_ARGS) && exit $$rc

# src on the path: the lock is made before (and without) the editable install of setup-env.sh
lock:  ## regenerate requirements/cpu.lock and mutation.lock from their .in files
	PYTHONPATH=$(CURDIR)/src $(VENV)/bin/python -m kmesh.tools.lock cpu
	PYTHONPATH=$(CURDIR)/src $(VENV)/bin/python -m kmesh.tools.lock mutation
