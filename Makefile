# The two commands of README.md. Both set up .venv from requirements/cpu.lock first (idempotent).
SHELL := /bin/bash
VENV := .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export LMCACHE_TRACK_USAGE := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# Byte-code is written, as pip writes it at install (setup-env.sh installs without it and compiles what most processes
# import): a shell that sets PYTHONDONTWRITEBYTECODE (this machine's sessions do) made every process compile again
# what the first one already had, e.g. each vLLM engine ~240 modules (2.7 of its 23.5 CPU-s), each Snakemake its own.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: env pipeline test test-all lint doctor lock mutation slurm-cluster

env:
	scripts/setup-env.sh

# One console line per stage as it starts (with its expected time) and ends, a progress line every 30 s while a stage
# runs; Snakemake's full output: results/<profile>/logs/snakemake.log. PROFILE_OVERLAY=long: the long forms
# (config/overlays/long.yaml) into results/long (another --config in SNAKEMAKE_ARGS replaces this one: name both there).
PROFILE_OVERLAY ?=
OVERLAY_CONFIG := $(if $(PROFILE_OVERLAY),--config overlay=$(PROFILE_OVERLAY) results_dir=results/$(PROFILE_OVERLAY))
pipeline: env  ## run every stage on the CPU profile (~10 min on 2 cores), then tables + plots; PROFILE_OVERLAY=long: the long forms
	@echo "[kmesh] host: $$(python -m kmesh host-speed)"
	python -m kmesh pipeline --cores all $(OVERLAY_CONFIG) $(SNAKEMAKE_ARGS)

# Every stage AND the whole suite (scripts/test.sh): the cpu pipeline at config/overlays/test.yaml's reduced sizes
# into results/test beside the suite, then tests/test_stage_results.py fails on a missing, stale or failed stage.
test: env  ## every stage on the cpu profile (reduced sizes, into results/test) beside the test suite; CI runs this
	scripts/test.sh $(PYTEST_ARGS)

# Ruff with pyproject.toml's [tool.ruff] rules (ruff is pinned in requirements/cpu.lock); make test runs it first.
# `ruff check --fix src tests` fixes the violations it marks [*].
lint: env  ## ruff check src tests: lint, the first step of make test
	python -m ruff check src tests

# The whole suite alone, the covered_by_stage tests included (no pipeline beside it).
test-all: env  ## the whole test suite, every test (no stage run)
	KMESH_REQUIRE_VLLM=1 python -m pytest -q $(PYTEST_ARGS)

slurm-cluster:  ## a single-node SLURM cluster on this machine (root; apt-get) for the slurm profile and its test
	scripts/slurm-local.sh

doctor: env
	python -m kmesh doctor

# Not in CI (far too slow for 2 cores). mutmut keeps its results in mutants/ and retests only what changed.
MUTATION_JOBS ?= 2
MUTATION_SET ?=
mutation: env  ## mutation testing of layout, rope, restore, service registry, transfer engine (pyproject [tool.mutmut]); MUTATION_SET=trust: another set
	$(VENV)/bin/python -m pip install --quiet --require-hashes --no-deps -r requirements/mutation.lock
ifneq ($(MUTATION_SET),)
	$(VENV)/bin/python -m kmesh.devtools.mutation_set $(MUTATION_SET) --jobs $(MUTATION_JOBS) $(MUTATION_REPORT_ARGS)
else
	# mutants/src must exist before Python starts: a PYTHONPATH entry that is missing at start-up is cached as
	# "nothing here", and the tests (and the service processes they start) would then import the unmutated code.
	mkdir -p results/mutation mutants/src
	PYTHONPATH=$(CURDIR)/mutants/src mutmut run --max-children $(MUTATION_JOBS) > results/mutation/mutmut.log 2>&1; \
	  rc=$$?; tr '\r' '\n' < results/mutation/mutmut.log | grep -a -E "mutations/second|Stopping|failed to" | tail -3; \
	  python -m kmesh.devtools.mutation_report $(MUTATION_REPORT_ARGS) && exit $$rc
endif

# src on the path: the lock is made before (and without) the editable install of setup-env.sh
lock:  ## regenerate requirements/cpu.lock and mutation.lock from their .in files
	PYTHONPATH=$(CURDIR)/src $(VENV)/bin/python -m kmesh.devtools.lock cpu
	PYTHONPATH=$(CURDIR)/src $(VENV)/bin/python -m kmesh.devtools.lock mutation
