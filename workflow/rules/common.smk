# Shared definitions: profile, paths, and what `rule all` asks for.
import glob

from snakemake.utils import validate

import kmesh.config
import kmesh.stage_times
import kmesh.stages

validate(config, "../../config/config.schema.yaml")

PROFILE = config.get("profile", "cpu")
RESULTS = config.get("results_dir", "results")
# An overlay over the profile, by file or name (make test: test; the long forms: long); an input of every stage.
OVERLAY = kmesh.config.overlay_file(config["overlay"]) if config.get("overlay") else None
# A stage needs a GPU only on the cuda profile. None (not 0) drops the `gpu` resource: executor plugins read its
# presence (the Kubernetes one would request `nvidia.com/gpu: 0` and add the GPU toleration for `gpu=0`).
GPU = 1 if PROFILE == "cuda" else None
# Threads a stage declares: the cores it keeps busy, so that Snakemake runs beside each other only stages that fit
# the machine together. Snakemake exports a job's threads as OMP_NUM_THREADS / MKL_NUM_THREADS (torch's intra-op
# threads). The stages that start vLLM engines bound to both cores (threads_bind "0-1": peers, vllm) declare 2
# (ENGINE_THREADS): nothing runs beside them on the 2-core machine, and their engines run as a user runs vLLM, on
# every core. Every other stage declares 1 and runs beside another: the work is about the same either way
# (equivalence 303 CPU-s at one thread, 316 at two), but two one-thread stages side by side keep both cores busy
# where one two-thread stage kept ~1.6 of them, so the pipeline ends sooner (docs/testing.md, "How the stages share
# the 2 cores"). Their timed pairs then share the machine with another stage's work; each arm of a pair does, in
# balanced order (never compare a stage's absolute times across runs).
ENGINE_THREADS = 2
ENGINE_STAGES = ["peers", "vllm"]


def stage_threads(stage):
    return ENGINE_THREADS if stage in ENGINE_STAGES else 1


# Critical path first: of the stages ready to run, Snakemake starts those of highest priority first. A stage's
# priority is the longest chain of wall time from its start to the pipeline's end: its own wall time in the committed
# table of this run's variant (docs/measurements/stage-times.json: "cpu+test" for make test, else "cpu"), plus the
# largest priority of the stages that wait for it (their inputs, order-only ones included). So the chain
# model -> reliability -> peers -> vllm -> report starts before equivalence, the longest single stage, and the short
# stages fill the other core beside them (critical-path list scheduling; until 2026-12-07 a stage's own wall time
# only, and the engine chain ran last, alone on ~1 of make test's 2 cores after the suite had ended). A stage the
# table lacks counts 0 s. Priorities order the jobs; they never change what a stage computes. The priority is a
# function: Snakemake evaluates it when it builds the jobs, after every rule file is read.
_VARIANT = kmesh.stage_times.variant(PROFILE, [OVERLAY] if OVERLAY else [])
_COMMITTED_WALL = {stage: t.wall_s for stage, t in (kmesh.stage_times.from_committed(_VARIANT)
                                                   or kmesh.stage_times.from_committed("cpu")).items()}


def _waiting_on(stage):
    """The stages whose rules list `stage`'s result among their inputs."""
    produced = result(stage)
    return [s for s in kmesh.stages.STAGES if produced in {str(f) for f in workflow.get_rule(s).input}]


def _critical_path_s(stage, _seen=()):
    if stage in _seen:  # a cycle Snakemake itself would refuse; never loop here
        return 0.0
    after = [_critical_path_s(s, (*_seen, stage)) for s in _waiting_on(stage)]
    return _COMMITTED_WALL.get(stage, 0.0) + max(after, default=0.0)


def stage_priority(stage):
    def priority(wildcards):
        return int(_critical_path_s(stage))

    return priority


# The stages whose results `rule all` and the report read, in pipeline order (every stage of kmesh.stages.STAGES, the
# one list of the stages, but the report itself). The Snakefile includes each stage's rule file from the same list.
STAGES = [s for s in kmesh.stages.STAGES if s != "report"]


# The package modules each stage runs are inputs of its job. After a change to one of them Snakemake reruns that stage
# (and what depends on it) and nothing else. A stage's own module or folder is always one (stage_code).
# The cache service: its modules and the remote tier's store client it loads (kmesh.service.remotetier).
SERVICE_CODE = ["service/*.py", "zygote.py", "storage/errors.py", "storage/remote.py", "storage/remote_agent.py",
                "storage/objfile.py", "integrity/*.py", "transfer/*.py"]
# A saved segment's round trip (kmesh.kv: layouts, restore, records, the service link, the load step, the repair entry).
KV_CODE = ["kv/*.py", "transfer/errors.py", "cuda/*.py", "sources/__init__.py", "sources/digest.py", "integrity/*.py"]
# What a child request runs on (the harness's children, the model, the kv package, the cache service they load from):
# the model stages share it.
# harness/invariants.py replays repairs with the float64 references (reference/*.py)
CHILD_CODE = ["model/*.py", "harness/*.py", "reference/*.py", *KV_CODE, *SERVICE_CODE]
STAGE_CODE = {
    "sources": ["sources/*.py"],
    "kernels": [],
    "model": ["model/*.py", "sources/__init__.py", "sources/digest.py"],
    "synthetic": [*KV_CODE, "reference/*.py", "vllm/*.py"],
    "drain": ["transfer/*.py"],
    "ownership": [*SERVICE_CODE, "harness/service.py", "harness/worker.py", "kv/layout.py"],
    "equivalence": [*CHILD_CODE, "vllm/*.py"],
    "integrity": ["integrity/*.py", "cuda/*.py"],
    "group": CHILD_CODE,
    "storage": [*CHILD_CODE, "storage/*.py"],
    "remote": [*CHILD_CODE, "storage/*.py"],
    "restore_bench": KV_CODE,
    "vllm": [*CHILD_CODE, "vllm/*.py"],
    "peers": [*CHILD_CODE, "vllm/*.py"],
    "reliability": ["reliability/*.py", *SERVICE_CODE, "harness/*.py", "storage/*.py", "vllm/*.py", "model/*.py",
                    *KV_CODE],
    "report": ["report/*.py"],
}

# What decides every stage's outcome (pass/fail/skip logic, provenance, the result writer, the CLI, the config that
# is validated and applied, incl. this profile's skip allowances): an input of EVERY stage, so editing it reruns all.
SHARED_CODE = [
    "__init__.py", "__main__.py", "cli.py", "config.py", "result.py", "provenance.py", "pins.py", "jsonfile.py",
    "errors.py", "bench.py", "progress.py", "stages/__init__.py",
]
SHARED_CONFIG = ["config/config.yaml", "config/config.schema.yaml", f"config/profiles/{PROFILE}.yaml",
                 *([OVERLAY] if OVERLAY else [])]


def stage_code(stage):
    patterns = [f"stages/{stage}.py", f"stages/{stage}/*.py", *STAGE_CODE[stage], *SHARED_CODE]
    code = sorted({f for p in patterns for f in glob.glob(f"src/kmesh/{p}")})
    missing = [p for p in SHARED_CODE if not glob.glob(f"src/kmesh/{p}")]
    if missing:  # a renamed shared module must not silently drop out of every stage's inputs
        raise ValueError(f"SHARED_CODE names missing modules: {missing}")
    return code + SHARED_CONFIG


def result(stage):
    return f"{RESULTS}/{PROFILE}/{stage}/result.json"


def logfile(stage):
    return f"{RESULTS}/{PROFILE}/logs/{stage}.log"


def kmesh_run(stage):
    """The one call a stage rule makes (the stage writes its result even when cases fail)."""
    overlay = f"--overlay {OVERLAY} " if OVERLAY else ""
    return (f"python -m kmesh run {stage} --profile {PROFILE} --set results_dir={RESULTS} {overlay}"
            f"--out {{output.result}} > {{log}} 2>&1")


def all_outputs():
    return [result(s) for s in STAGES] + [
        f"{RESULTS}/{PROFILE}/tables/summary.md",
        f"{RESULTS}/{PROFILE}/plots/summary.png",
    ]
