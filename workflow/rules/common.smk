# Shared definitions: profile, paths, and what `rule all` asks for.
import glob

from snakemake.utils import validate

validate(config, "../../config/config.schema.yaml")

PROFILE = config.get("profile", "cpu")
RESULTS = config.get("results_dir", "results")
GPU = 1 if PROFILE == "cuda" else 0
# Stages that exist in this wave, in pipeline order; report renders whatever they wrote.
STAGES = ["sources", "kernels", "model", "synthetic", "drain", "ownership"]


# The package modules each stage runs are inputs of its job. After a change to one of them Snakemake reruns that stage
# (and what depends on it) and nothing else. Shared machinery (config, result, bench) is left out on purpose.
STAGE_CODE = {
    "sources": ["sources/*.py", "pins.py"],
    "kernels": [],
    "model": ["model/*.py"],
    "synthetic": ["layout.py", "rope.py", "restore.py", "cuda/*.py", "vllm/*.py"],
    "drain": ["transfer/*.py", "shm.py", "stages/drain_client.py"],
    "ownership": ["service/*.py", "transfer/*.py", "shm.py", "layout.py"],
    "report": ["report/*.py"],
}


def stage_code(stage):
    patterns = [f"stages/{stage}.py", *STAGE_CODE[stage]]
    return sorted({f for p in patterns for f in glob.glob(f"src/kmesh/{p}")})


def result(stage):
    return f"{RESULTS}/{PROFILE}/{stage}/result.json"


def logfile(stage):
    return f"{RESULTS}/{PROFILE}/logs/{stage}.log"


def kmesh_run(stage):
    """The one call a stage rule makes (the stage writes its result even when cases fail)."""
    return (f"python -m kmesh run {stage} --profile {PROFILE} --set results_dir={RESULTS} "
            f"--out {{output.result}} > {{log}} 2>&1")


def all_outputs():
    return [result(s) for s in STAGES] + [
        f"{RESULTS}/{PROFILE}/tables/summary.md",
        f"{RESULTS}/{PROFILE}/plots/summary.png",
    ]
