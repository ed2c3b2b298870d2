"""Pipeline stages: one module each, `run(cfg: Config) -> Result`.

The Snakemake rule of a stage is only inputs, outputs, log, resources and one call of
`python -m kmesh run STAGE --profile P`; everything else lives in the stage module.
"""
from __future__ import annotations

import importlib
from typing import Callable

from kmesh.config import Config
from kmesh.errors import StageError
from kmesh.result import Result

# Pipeline order (DESIGN §3). Later waves add equivalence, storage, group.
STAGES: tuple[str, ...] = ("sources", "kernels", "model", "synthetic", "drain", "ownership", "equivalence", "storage",
                           "integrity", "remote", "group", "reliability", "peers", "vllm", "restore_bench", "report")


def stage_runner(name: str) -> Callable[[Config], Result]:
    if name not in STAGES:
        raise StageError(f"unknown stage {name!r}; known: {', '.join(STAGES)}")
    try:
        module = importlib.import_module(f"kmesh.stages.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"kmesh.stages.{name}":
            raise StageError(f"stage {name!r} is not implemented yet") from e
        raise
    return module.run


def result_path(cfg: Config, name: str) -> str:
    return str(cfg.results_dir / cfg.profile / name / "result.json")
