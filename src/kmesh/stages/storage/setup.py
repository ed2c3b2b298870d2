"""What every case of the storage stage starts from: the model stage setup (kmesh.harness.modelsetup) with the stage's
object directory and I/O settings, and the summary form in which its cases report a paired timing."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kmesh.bench import PairedTiming
from kmesh.config import Config
from kmesh.harness.modelsetup import ModelSetup, SetupSpec, build_setup
from kmesh.storage import routes


@dataclasses.dataclass
class Setup(ModelSetup):
    root: Path = Path()                            # where the stage's object files live
    io: routes.IOSettings = routes.IOSettings()


def storage_setup(cfg: Config) -> Setup:
    """Model, workload and leader export as the equivalence section describes them; storage's own settings."""
    eq, sec = cfg.section("equivalence"), cfg.section("storage")
    base = build_setup(cfg, SetupSpec(
        section="storage", key_prefix=b"kmesh-storage/leader", model_sec=eq, workload=eq.get("workload", {}),
        repair=eq["repair"], max_new_tokens=int(sec["max_new_tokens"]),
        restore_backend=eq.get("restore_backend", "torch"), device=sec["device"]))
    root = Path(sec["objects_dir"]) if sec.get("objects_dir") else cfg.results_dir / cfg.profile / "storage" / "objects"
    return Setup(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ModelSetup)}, root=root,
                 io=routes.IOSettings.of(sec.get("io")))


def timing_device(setup: Setup) -> str:
    """The kmesh.bench device of the stage's intervals (CUDA events on a GPU, perf_counter otherwise)."""
    return "cuda" if setup.device.type == "cuda" else "cpu"


def paired_summary(timing: PairedTiming) -> dict[str, Any]:
    return {part: {"median_diff_s": v["median_diff"], "median_ratio": v["median_ratio"],
                   "b_faster": v["b_faster"], "pairs": v["pairs"]} for part, v in timing.summary().items()}


def tree_chunk_bytes(setup: Setup) -> int:
    """The sha256-tree chunk size of the stage's object sets: storage.checksums, else the integrity section's."""
    conf = dict(setup.sec.get("checksums") or {})
    return int(conf.get("tree_chunk_bytes", setup.cfg.section("integrity").get("tree_chunk_bytes", 65536)))
